"""What the scheduler half remembers of one request, and the keys, digests and slots it derives from it.

A request's chunk keys are a chain over its tokens in a context (salt, LoRA
adapter, media: :mod:`~vllm_kvcodec.keys.identity`), extended as its tokens
grow and cut where a streaming-input session changes what it holds; every
plan for it (loads, saves, refs, token digests) is made from that chain. The
state updates itself from what vLLM tells the scheduler (its blocks, its
computed tokens) and from what the workers report (a failed load); the
planners (:mod:`~.load_planner`, :mod:`~.save_planner`) decide what to do with it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.connector.cache_groups import CacheGroups
from vllm_kvcodec.connector.lookup import Tail
from vllm_kvcodec.connector.lora_keys import AdapterKeys
from vllm_kvcodec.connector.precisions import Precisions
from vllm_kvcodec.format import TokenDigests
from vllm_kvcodec.keys.block_refs import prefix_hashes
from vllm_kvcodec.keys.chain import Namespace, extend_chunk_hashes, tail_hash
from vllm_kvcodec.keys.identity import PromptIdentity, prompt_identity
from vllm_kvcodec.keys.token_digests import token_digests
from vllm_kvcodec.paged.slots import slots_for_tokens
from vllm_kvcodec.stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

#: ``save_attempts`` key of the request's prompt tail (chunks count from 0).
TAIL = -1


@dataclasses.dataclass
class Keying:
    """What every request's keys are made in: shared by all their states, so the namespace an fp8 cache completes at
    the workers' handshake reaches every one (no request is keyed before it)."""

    namespace: Namespace
    chunk: int  # tokens per chunk
    digest_unit: int  # tokens per token digest
    cache_groups: CacheGroups
    adapters: AdapterKeys
    stats: ConnectorStats
    block_hits: bool
    precisions: Precisions = dataclasses.field(default_factory=Precisions)
    _lossy: tuple[Namespace, Namespace] | None = dataclasses.field(default=None, repr=False)

    @property
    def alignment(self) -> int:
        """Where vLLM's own cache ends a hit: tails, refs and finishing tails end on it."""
        return self.cache_groups.hit_alignment

    @property
    def raw_bytes_per_token(self) -> int:
        """Raw KV bytes of one token on one worker (its stage's layers, its share of the heads): what a load moves."""
        ns = self.namespace
        layers = max(len(stage) for stage in ns.stages())
        return layers * 2 * ns.num_kv_heads * ns.head_dim * DType.parse(ns.dtype).itemsize

    def namespace_of(self, precision: str) -> Namespace:
        """The namespace a request of ``precision`` is keyed in (made once per base namespace: its digest is hashed)."""
        level = self.precisions.level
        if level is None or precision != level.name:
            return self.namespace
        if self._lossy is None or self._lossy[0] is not self.namespace:
            self._lossy = (self.namespace, self.precisions.namespace(self.namespace, precision))
        return self._lossy[1]


def shape_of(request: "Request") -> tuple[int, int]:
    """What a streaming-input update changes: the prompt's length and its media items (see follow_session)."""
    return request.num_prompt_tokens, len(getattr(request, "mm_features", None) or ())


@dataclasses.dataclass
class RequestState:
    """One request as the scheduler half knows it."""

    request: "Request"
    keying: Keying
    identity: PromptIdentity | None = None  # None: never cached (prompt embeddings, unknown LoRA weights)
    shape: tuple[int, int] = (0, 0)  # (prompt tokens, media items) the identity and chain were made for
    hashes: list[str] = dataclasses.field(default_factory=list)  # chain over the full chunks so far
    hit_chunks: int = 0  # chunks found in the store at the last lookup
    looked_up: bool = False  # False: the next lookup asks the store (new, preempted, or after a failure)
    local_tokens: int = 0  # tokens vLLM had in its own prefix cache at lookup
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # per KV cache group (0: vLLM's null block)
    next_save: int = 0  # first chunk not yet handed to the worker for saving
    computed: int = 0  # tokens computed before the current step
    save_attempts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures_seen: int = 0  # failed loads of this request reported so far
    deferred: set[int] = dataclasses.field(default_factory=set)  # chunks not planned while the store was down
    tail: Tail | None = None  # the whole blocks after the hit chunks found at the last lookup (block_hits)
    tail_planned: bool = False  # this request's own tail was planned for saving (or needs none)
    tail_save: str = ""  # the key its own tail was saved under
    awaiting_room: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk (TAIL: tail) -> bytes it needs
    waiting_on: set[str] = dataclasses.field(default_factory=set)  # chunks it left to another request's save
    prefetching: bool = False  # the worker was asked to fetch its hit ahead (see load/prefetch.py)
    loads: set[int] = dataclasses.field(default_factory=set)  # its loads not reported yet (ledger ids), not others'
    adapter: tuple[int, str] | None = None  # LoRA: (adapter id, weights its keys name), see lora_keys.py
    adapter_reloaded: bool = False  # the workers reloaded its adapter from other files while it ran: never cached
    precision: str = LOSSLESS  # what it is keyed in: the engine's setting, or lossless where it demands it
    load_budget_s: float = 1.0  # precision auto: how long its load may take before it reads lossy variants
    lossy_from: int | None = None  # its first token whose KV may be lossy (a lossy load, a lossy local hit)

    @classmethod
    def new(cls, request: "Request", keying: Keying) -> "RequestState":
        precision, budget = keying.precisions.of_request(request)
        state = cls(request, keying, shape=shape_of(request), precision=precision, load_budget_s=budget)
        if state.identify() is not None and state.identity is None:
            keying.stats.add(uncacheable_requests=1)
        return state

    @property
    def req_id(self) -> str:
        return self.request.request_id

    @property
    def namespace(self) -> Namespace:
        """Its keys' namespace: the engine's, or a lossy level's (see connector/precisions.py)."""
        return self.keying.namespace_of(self.precision)

    @property
    def keyed_in(self) -> str:
        """The precision of the namespace its keys are in: its lossy level, else lossless (auto's keys too)."""
        return self.precision if self.namespace is not self.keying.namespace else LOSSLESS

    def holds_lossy(self, from_token: int) -> None:
        """Its KV from ``from_token`` on may be lossy (read lossy, or computed over lossy KV)."""
        self.lossy_from = from_token if self.lossy_from is None else min(self.lossy_from, from_token)

    # ---- its keys -------------------------------------------------------------------
    def identify(self) -> str | None:
        """Key it by its context as it is now, its LoRA adapter by the weights the workers loaded (lora_keys.py);
        returns those weights ("" without an adapter; None: unknown, counted there)."""
        lora = getattr(self.request, "lora_request", None)
        weights = self.keying.adapters.weights(lora) if lora is not None else ""
        self.identity = None if self.adapter_reloaded else prompt_identity(self.request, weights)
        self.adapter = (lora.lora_int_id, weights) if lora is not None and weights else None
        return weights

    def follow_session(self) -> None:
        """A streaming-input session grew under the same request: key it by what it holds now.

        vLLM's resumable requests (streaming input) take each update into the
        same ``Request`` between turns, with no ``request_finished`` in between:
        the kept output joins the prompt, the new tokens follow, and new media
        items come with them. The identity made at the first lookup lacks
        those items, so every chunk they touch would be keyed, saved and
        looked up as if the image were any other image with the same
        placeholder tokens. Whenever the prompt or its media change, the
        identity is made anew and the key chain is cut at the first chunk
        whose tokens may have changed (vLLM keeps only the computed ones) or
        that a new item touches; that chunk and every later one are keyed
        again, and the prompt's tail is planned anew for the longer prompt.
        """
        shape = shape_of(self.request)
        if shape == self.shape:
            return
        self.shape = shape
        old = self.identity
        self.identify()
        new, chunk = self.identity, self.keying.chunk
        keep = 0
        if old is not None and new is not None and (old.salt, old.lora) == (new.salt, new.lora):
            added = [offset for offset, _ in set(new.media) - set(old.media)]
            keep = min([self.request.num_computed_tokens // chunk, len(self.hashes)] + [o // chunk for o in added])
        self.hashes = self.hashes[:keep]
        self.next_save = min(self.next_save, keep)
        self.tail, self.tail_planned, self.tail_save = None, False, ""
        for c in [c for c in self.save_attempts if c >= keep or c == TAIL]:
            del self.save_attempts[c]  # other keys now: their saves start afresh
        self.keying.stats.add(session_updates=1)

    def chunk_hashes(self, num_chunks: int) -> list[str]:
        """Its first ``num_chunks`` chunk keys, extending the chain as its tokens grow."""
        self.follow_session()
        if len(self.hashes) < num_chunks and self.identity is not None:
            self.hashes = extend_chunk_hashes(self.namespace, self.request.all_token_ids, self.hashes,
                                              num_chunks, self.identity)
        return self.hashes[:num_chunks]

    def loadable(self) -> list[str]:
        """The keys of its whole chunks before its last token (vLLM must compute that one to sample the next)."""
        return self.chunk_hashes(max(0, self.request.num_tokens - 1) // self.keying.chunk)

    def tail_hash(self, index: int, tokens: int) -> str:
        """The key of its ``tokens`` tokens after chunk ``index``'s start (a prompt's or a finishing tail)."""
        return tail_hash(self.namespace, self.request.all_token_ids, self.chunk_hashes(index), tokens,
                         self.identity)

    def digests(self, index: int, tokens: int) -> TokenDigests:
        """The digests of its first ``tokens`` of chunk ``index`` (rounded up to whole digests) that an object loaded
        or saved there must record (see keys/token_digests.py)."""
        unit, chunk = self.keying.digest_unit, self.keying.chunk
        tokens = min(-(-tokens // unit) * unit, (self.request.num_tokens - index * chunk) // unit * unit)
        return token_digests(self.namespace, self.request.all_token_ids, self.chunk_hashes(index), tokens, unit,
                             self.identity)

    def refs(self, index: int, tokens: int) -> list[tuple[str, int]]:
        """The whole-block prefixes of an object of ``tokens`` tokens at chunk ``index`` (block_hits; see
        keys/block_refs.py): what a prompt sharing only those blocks looks up."""
        if not self.keying.block_hits or self.identity is None:
            return []
        return prefix_hashes(self.namespace, self.request.all_token_ids, self.hashes[:index], tokens,
                             self.keying.alignment, self.identity)

    # ---- its blocks -----------------------------------------------------------------
    def slots(self, first: int, tokens: int) -> list[list[int]]:
        """Each KV cache group's slots of its tokens ``[first, first + tokens)``."""
        return [slots_for_tokens(table, bs, first, first + tokens).tolist()
                for table, bs in zip(self.block_ids, self.keying.cache_groups.block_sizes)]

    def local_hit_blocks(self, manager: "KVCacheManager") -> list[list[int]]:
        """Each group's blocks vLLM is about to give it as its local hit (``local_tokens``): what vLLM's scheduler got
        from ``get_computed_blocks`` just before asking, nothing having changed since (the same call of its KV cache
        coordinator's ``find_longest_cache_hit``, with the same arguments, free of ``get_computed_blocks``' side
        effects such as its KV events), cut to the local hit it offered."""
        hit = manager.coordinator.find_longest_cache_hit(self.request.block_hashes, self.request.num_tokens - 1)[0]
        return [[b.block_id for b in blocks[: self.local_tokens // bs]]
                for blocks, bs in zip(hit, self.keying.cache_groups.block_sizes)]

    def blocks_held(self, chunk: int, tokens: int | None = None) -> bool:
        """Whether every group still holds chunk ``chunk``'s blocks in this step (a window group frees those below it).

        ``chunk_size <= sliding_window`` makes this true for a chunk completed in
        this step; it is false for a retry of an older chunk whose blocks vLLM
        may have handed to another request already.
        """
        groups, size = self.keying.cache_groups, self.keying.chunk
        start, end = chunk * size, chunk * size + (tokens or size)
        for g, table in enumerate(self.block_ids):
            bs = groups.block_sizes[g]
            if start < groups.freed_below(g, self.computed):
                return False
            if 0 in table[start // bs : end // bs]:
                return False
        return True

    def scheduled(self, block_ids: Any, computed: int, anew: bool) -> None:
        """vLLM scheduled it: its tokens computed before this step, and its blocks: all of them (``anew``: a new or
        resumed request), else the step's new ones (None: none)."""
        if block_ids is not None and anew:
            self.block_ids = [list(g) for g in block_ids]
        elif block_ids is not None:
            for table, added in zip(self.block_ids, block_ids):
                table.extend(added)
        self.computed = computed

    # ---- what the workers report ----------------------------------------------------
    def load_failed(self, failed: list[str]) -> None:
        """Its load failed on these chunks: vLLM recomputes from the first of them, and that chunk and every later
        one are saved anew (a failed tail is recomputed, then saved as a new tail)."""
        self.failures_seen += 1
        chunks = [self.hashes.index(h) for h in failed if h in self.hashes]
        if self.tail is not None and self.tail.chunk_hash in failed:
            self.tail, self.tail_planned = None, False
        elif not chunks:
            chunks = [0]  # failed hashes it does not know: trust none of its chunks
        if chunks:
            self.hit_chunks = min(self.hit_chunks, min(chunks))
            self.next_save = min(self.next_save, min(chunks))

    def adapter_reloaded_elsewhere(self, loads: dict[int, str]) -> None:
        """The workers (re)loaded adapters: if its own came from other files, it is cached no further."""
        if self.adapter is not None and loads.get(self.adapter[0], self.adapter[1]) != self.adapter[1]:
            self.identity, self.adapter, self.adapter_reloaded = None, None, True
