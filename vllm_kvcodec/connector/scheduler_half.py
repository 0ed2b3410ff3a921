"""Scheduler half: lookup of stored prefixes, load and save planning, and what their outcomes teach.

Runs in vLLM's scheduler process; never touches KV memory. It finds the
longest stored prefix in whole chunks (a question per request, asked again
only after a preemption; answered inline or by the lookup thread, batched
over the step's requests: :mod:`~.lookup`), tells vLLM how
many tokens beyond its local prefix cache it can load, and turns block
allocations into slot mappings for the worker half: loads of stored chunks,
and saves of every chunk that becomes full, prompt or output, including
chunks completed across several steps of a chunked prefill. With
``block_hits`` (the default) a hit ends where vLLM's own prefix cache would
end: it also saves each prompt's tail past its last full chunk (whole blocks,
up to the block holding the last token) under a key that hangs off the chain
(:func:`~vllm_kvcodec.keys.chain.tail_hash`), and, when a request finishes, the
part of prompt and answer past their last full chunk (a chat's next turn);
every saved object gets a ref per whole-block prefix
(:mod:`~vllm_kvcodec.keys.block_refs`), and a lookup reads, in a second batched
call, the refs of the whole-block prefixes right after its hit chunks and
loads the longest that is stored: the same tokens vLLM would take from its
own cache, so the same rounding and the same greedy tokens.

Block ids come per vLLM KV cache group (the hybrid manager's groups, see
:mod:`~.cache_groups`): loads write each group's allocated blocks (a
sliding-window group's window only), saves gather each group's blocks of the
chunk in the step that completes it.

The worker's reports (:class:`~.metadata.KVCodecWorkerReport`) close the loop:

- a failed load marks its chunks failed (:mod:`~.load_ledger`), so no lookup
  offers them again until they are replaced, and *evicts* the request's
  blocks from the failed one on from vLLM's prefix cache: under vLLM's
  ``recompute`` policy those blocks keep their prefix hashes, and a request
  aborted before its recompute would otherwise leave KV that was never
  written to be served as a local hit;
- a save that did not land releases its de-duplication claim and is planned
  again while its request still holds the blocks (a bounded number of times);
  a request that recomputes a failed chunk saves it, replacing the object.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from storage import StoreError
from storage.outage import StoreDownError
from vllm_kvcodec.keys.block_refs import Ref, parse_ref, prefix_hashes, ref_key
from vllm_kvcodec.connector.background_work import KeepStepping
from vllm_kvcodec.connector.cache_groups import CacheGroups
from vllm_kvcodec.connector.cache_identity import agreed_scales, is_fp8
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.format import TokenDigests
from vllm_kvcodec.keys.identity import PromptIdentity, prompt_identity
from vllm_kvcodec.keys.chain import Namespace, chunk_object_keys, extend_chunk_hashes, tail_hash, tail_position
from vllm_kvcodec.connector.kv_events import StoreEvents
from vllm_kvcodec.connector.load_ledger import LoadLedger, RestingSave
from vllm_kvcodec.connector.lora_keys import AdapterKeys
from vllm_kvcodec.connector.lookup import Answer, AsyncLookup, Question, Tail, answer_questions, tail_candidates
from vllm_kvcodec.connector.lookup_budget import LookupBudget
from vllm_kvcodec.connector.metadata import KVCodecMetadata, KVCodecWorkerReport
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec, PrefetchSpec
from vllm_kvcodec.plans.outcomes import LoadOutcome, SaveOutcome
from vllm_kvcodec.plans.saves import SaveSpec
from vllm_kvcodec.paged.slots import slots_for_tokens
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.connector.save_claims import SaveClaims
from vllm_kvcodec.stats import ConnectorStats
from vllm_kvcodec.connector.store_access import open_connector_store
from vllm_kvcodec.keys.token_digests import digest_unit, token_digests

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvcodec")
_T = TypeVar("_T")
#: Saves of one chunk one request may plan (the first, and retries after it did not land).
MAX_SAVE_ATTEMPTS = 3
#: ``save_attempts`` key of the request's prompt tail (chunks count from 0).
TAIL = -1
#: Slack beyond the load timeout before a load that never reported stops holding other requests back.
INFLIGHT_SLACK_S = 10.0
#: How long a step with nothing scheduled waits for lookups in the air (their answers admit the next requests).
LOOKUP_IDLE_WAIT_S = 0.01


def _shape(request: "Request") -> tuple[int, int]:
    """What a streaming-input update changes: the prompt's length and its media items (see _follow_session)."""
    return request.num_prompt_tokens, len(getattr(request, "mm_features", None) or ())


def _finished_whole() -> frozenset[Any]:
    """Request statuses whose every step ran to its end (stop or length): their KV up to the last token is written."""
    from vllm.v1.request import RequestStatus

    return frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


@dataclasses.dataclass
class _Tracked:
    """What the scheduler half remembers about one request."""

    request: "Request"
    identity: PromptIdentity | None  # None: never cached (prompt embeddings, unknown LoRA weights)
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
    finish_planned: bool = False  # its finishing tail (block_hits) was planned: vLLM holds its blocks until saved
    awaiting_room: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk (TAIL: tail) -> bytes it needs
    waiting_on: set[str] = dataclasses.field(default_factory=set)  # chunks it left to another request's save
    prefetching: bool = False  # the worker was asked to fetch its hit ahead (see load/prefetch.py)
    loads: set[int] = dataclasses.field(default_factory=set)  # its loads not reported yet (ledger ids), not others'
    adapter: tuple[int, str] | None = None  # LoRA: (adapter id, weights its keys name), see lora_keys.py
    adapter_reloaded: bool = False  # the workers reloaded its adapter from other files while it ran: never cached


class SchedulerHalf:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, groups: int, tp_size: int,
                 cache_groups: CacheGroups, loaders: int = 1) -> None:
        """``loaders``: the workers that run each load and report its outcome (see load_ledger.py)."""
        self.config = config
        self.namespace = namespace
        self.groups = groups
        self.tp_size = tp_size
        self.cache_groups = cache_groups
        self.block_sizes = cache_groups.block_sizes
        self.chunk = config.chunk_size
        self.digest_unit = digest_unit(cache_groups.hit_alignment, self.chunk)  # tokens per token digest
        self.store = open_connector_store(config)
        self.stats = ConnectorStats()
        self.ledger = LoadLedger(inflight_ttl_s=config.load_timeout_s + INFLIGHT_SLACK_S, loaders=loaders)
        self.adapters = AdapterKeys(self.stats)
        self.claims = SaveClaims()
        self.events = StoreEvents.off()  # the facade turns them on when vLLM publishes KV events
        self.keep_stepping = KeepStepping(config.shutdown_flush_s)  # for the workers' saves and upgrades in flight
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM after construction
        self._requests: dict[str, _Tracked] = {}
        self._awaiting_room: dict[str, None] = {}  # requests with saves dropped for want of queue room, oldest first
        self._waiters: dict[str, set[str]] = {}  # chunk hash -> requests that left its save to another's claim
        self._pending_loads: list[LoadSpec] = []
        self._finishing: list[SaveSpec] = []  # finishing tails of requests vLLM ended (see _plan_finish)
        self._settled: dict[int, bool] = {}  # loads every worker reported since the last plan -> failed
        self.lookup_mode = config.lookup_mode()
        self.lookups = self._lookup_thread() if self.lookup_mode != "sync" and config.load else None
        self._prefetches = config.prefetches()
        self._to_prefetch: dict[str, None] = {}  # answered with a hit, not loaded yet: fetched ahead if it waits
        self._prefetch_done: list[str] = []  # requests whose objects fetched ahead the worker may drop
        # fp8 caches are keyed with their layers' scales, which only the workers know (adopt_handshake).
        self._awaiting_identity = is_fp8(namespace.dtype)

    def adopt_handshake(self, handshakes: dict[int, Any]) -> None:
        """The workers' KV cache identity (fp8 scales): completes the namespace before any request is keyed."""
        self.namespace = dataclasses.replace(self.namespace, kv_scales=agreed_scales(handshakes))
        digests = {h.namespace_digest for h in handshakes.values()}
        if digests != {self.namespace.digest}:
            raise ConfigError(f"kvcodec: workers key chunks under namespace {sorted(digests)}, the scheduler under "
                              f"{self.namespace.digest}; their configurations differ")
        self._awaiting_identity = False

    def _lookup_thread(self) -> AsyncLookup:
        """The lookup thread; with ``auto`` (adaptive), waited for within a step's budget while lookups fit it,
        measured from the start with empty existence checks (a chunk key no prompt has)."""
        budget, probe = None, None
        if self.lookup_mode == "adaptive":
            budget = LookupBudget(self.stats, floor_s=self.config.lookup_budget_ms / 1e3,
                                  share=self.config.lookup_budget_share)
            keys = chunk_object_keys(self.namespace, os.urandom(16).hex(), self.tp_size, self.groups)
            probe = lambda: self.store.exists_many(keys)  # noqa: E731
        return AsyncLookup(self._stored, self._resolve, self.stats, timeout_s=self.config.lookup_timeout_s,
                           max_batches=self.config.lookup_queue, budget=budget, probe=probe)

    def _identity_known(self) -> bool:
        """False until the workers' handshake told an fp8 cache's scales: no key can be made before (counted)."""
        if self._awaiting_identity:
            self.stats.add(requests_before_cache_identity=1)
            logger.warning("kvcodec: no KV cache identity from the workers yet (fp8 scales); not caching this request")
        return not self._awaiting_identity

    # ---- lookup ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._track(request)
        self._follow_session(tracked)
        tracked.local_tokens = num_computed_tokens
        if tracked.identity is None or not self._identity_known():
            return 0, False
        # Only whole chunks, and never the last token: vLLM must compute it to sample the next.
        loadable = self._hashes(tracked, max(0, request.num_tokens - 1) // self.chunk)
        if not tracked.looked_up:
            answer = self._look_up(tracked, loadable)
            if answer is None:
                return None, False  # asked in the background: vLLM asks again next step
            hit, tracked.tail = answer.hit, answer.tail
            tracked.hit_chunks, tracked.looked_up = hit, True
            if self._prefetches and (hit or tracked.tail):
                self._to_prefetch[request.request_id] = None
            tracked.next_save = min(tracked.next_save, hit) if tracked.computed else hit
            self.stats.add(lookups=1, lookup_chunks=len(loadable), hit_chunks=hit,
                           **({"hit_tail_tokens": tracked.tail.tokens} if tracked.tail else {}))
        hit = min(tracked.hit_chunks, self.ledger.first_failed(loadable))
        tail = self._usable_tail(tracked, hit)
        end = hit * self.chunk + (tail.tokens if tail else 0)
        if self._reads_inflight(tracked, loadable, max(end, num_computed_tokens)):
            self.stats.add(lookups_waiting_for_inflight_load=1)
            return None, False  # ask again next step, when that load has an outcome
        n = max(0, end - num_computed_tokens)
        return n, bool(n) and self.config.load_mode == "async"

    def _usable_tail(self, tracked: _Tracked, hit: int) -> Tail | None:
        """The stored tail, if every full chunk before it is still a hit and it is not known to fail."""
        tail = tracked.tail
        if tail is None or hit != tail.index or self.ledger.first_failed([tail.chunk_hash]) == 0:
            return None
        return tail

    def _reads_inflight(self, tracked: _Tracked, loadable: list[str], tokens: int) -> bool:
        """Whether the chunks of its first ``tokens`` (local hit and load) are being loaded by some request.

        With ``block_hits`` that includes any tail in flight after any of
        those chunks' predecessors, whatever its length (in-flight tails are
        tracked under their position as well as their key): its blocks may be
        part of this request's local hit.
        """
        reads = -(-tokens // self.chunk)
        busy = tracked.hashes[: min(reads, len(loadable))]
        if self.config.block_hits and tracked.identity is not None:
            busy += [tail_position(self.namespace, loadable[:k], tracked.identity) for k in range(min(reads, len(loadable) + 1))]
        return self.ledger.busy(busy) or self._local_hit_inflight(tracked.request, tracked.local_tokens)

    def _local_hit_inflight(self, request: "Request", local_tokens: int) -> bool:
        """Whether a load in flight writes any block vLLM is about to give ``request`` as its local hit.

        The chunk keys above miss a prompt that diverges inside a chunk being
        loaded: its key for the chunk differs, yet vLLM's prefix cache, block
        by block, hands it the loading request's blocks up to where it
        diverges (a sync load's blocks are registered at allocation). Under
        async scheduling it would compute over them before the load's failure
        is reported, and vLLM would not rewind it.

        The blocks are what vLLM's scheduler got from ``get_computed_blocks``
        just before asking, nothing having changed since: the same call of its
        KV cache coordinator's ``find_longest_cache_hit``, with the same
        arguments (exact, and free of ``get_computed_blocks``' side effects,
        such as its KV events), cut to the local hit it offered us. Its cost is
        vLLM's own lookup of the local hit again, paid only while some load
        writes blocks. Under sync scheduling vLLM would rewind such a request
        itself; waiting there too costs it a step and spares it computing over
        a load that fails.
        """
        manager = self.kv_cache_manager
        if not local_tokens or manager is None or not self.ledger.writing_any():
            return False
        hit = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[0]
        return self.ledger.writes_any([[b.block_id for b in blocks[: local_tokens // bs]]
                                       for blocks, bs in zip(hit, self.block_sizes)])

    def _track(self, request: "Request") -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = self._requests[request.request_id] = _Tracked(request, None, _shape(request))
            if self._identify(tracked) is not None and tracked.identity is None:
                self.stats.add(uncacheable_requests=1)
        return tracked

    def _identify(self, tracked: _Tracked) -> str | None:
        """Key the request by its context as it is now, its LoRA adapter by the weights the workers loaded
        (lora_keys.py); returns those weights ("" without an adapter; None: unknown, counted there)."""
        lora = getattr(tracked.request, "lora_request", None)
        weights = self.adapters.weights(lora) if lora is not None else ""
        tracked.identity = None if tracked.adapter_reloaded else prompt_identity(tracked.request, weights)
        tracked.adapter = (lora.lora_int_id, weights) if lora is not None and weights else None
        return weights

    def _follow_session(self, tracked: _Tracked) -> None:
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
        shape = _shape(tracked.request)
        if shape == tracked.shape:
            return
        tracked.shape = shape
        old = tracked.identity
        self._identify(tracked)
        new = tracked.identity
        keep = 0
        if old is not None and new is not None and (old.salt, old.lora) == (new.salt, new.lora):
            added = [offset for offset, _ in set(new.media) - set(old.media)]
            keep = min([tracked.request.num_computed_tokens // self.chunk, len(tracked.hashes)]
                       + [offset // self.chunk for offset in added])
        tracked.hashes = tracked.hashes[:keep]
        tracked.next_save = min(tracked.next_save, keep)
        tracked.tail, tracked.tail_planned, tracked.tail_save = None, False, ""
        for chunk in [c for c in tracked.save_attempts if c >= keep or c == TAIL]:
            del tracked.save_attempts[chunk]  # other keys now: their saves start afresh
        self.stats.add(session_updates=1)

    def _hashes(self, tracked: _Tracked, num_chunks: int) -> list[str]:
        """The request's first ``num_chunks`` chunk keys, extending the chain as its tokens grow."""
        self._follow_session(tracked)
        if len(tracked.hashes) < num_chunks and tracked.identity is not None:
            tokens = tracked.request.all_token_ids
            tracked.hashes = extend_chunk_hashes(self.namespace, tokens, tracked.hashes, num_chunks, tracked.identity)
        return tracked.hashes[:num_chunks]

    def _look_up(self, tracked: _Tracked, loadable: list[str]) -> Answer | None:
        """The longest stored prefix in whole chunks, then (``block_hits``) the longest stored block prefix after it.

        Inline (``lookup`` sync), or asked of the lookup thread (async:
        None until its answer is in, see :mod:`~.lookup`). A replay finds its
        own tail after its last full chunk; the next turn of a chat finds the
        last turn's after the chunks they share, however much it added.
        """
        if not self.config.load:
            return Answer(0)
        tails = None
        if self.config.block_hits and tracked.identity is not None:
            tokens = list(tracked.request.all_token_ids)  # a snapshot: the lookup thread hashes it
            namespace, identity, align = self.namespace, tracked.identity, self.cache_groups.hit_alignment

            def tails(hit: int) -> list[Tail]:
                return tail_candidates(namespace, tokens, identity, loadable[:hit], self.chunk, align)

            if not loadable and not tails(0):
                return Answer(0)  # nothing the store could hold: no question to ask
        elif not loadable:
            return Answer(0)
        question = Question(loadable, tails)
        if self.lookups is None:
            return answer_questions([question], self._stored, self._resolve)[0]
        key = (tuple(loadable), tracked.identity, tuple(tokens[len(loadable) * self.chunk:]) if tails else None)
        return self.lookups.ask(tracked.request.request_id, key, question)

    def _stored(self, hashes: list[str]) -> list[bool] | None:
        """Per chunk (or tail) key, whether every object of it (all ranks, all layer groups) is in the store;
        None when the store did not answer (counted: a miss)."""
        if not hashes:
            return []
        keys = [chunk_object_keys(self.namespace, h, self.tp_size, self.groups) for h in hashes]
        found = self._ask_store(lambda: self.store.exists_many([k for ks in keys for k in ks]),
                                "store lookup failed, computing the prefix instead")
        if found is None:
            return None
        per = len(keys[0])
        return [all(found[c * per : (c + 1) * per]) for c in range(len(hashes))]

    def _ask_store(self, call: Callable[[], _T], failure: str) -> _T | None:
        """A lookup's store call; None (counted: a miss) when the store did not answer."""
        try:
            return call()
        except StoreDownError:  # known outage, already logged once: a miss at no cost
            self.stats.add(lookup_failures=1, lookups_store_down=1)
        except StoreError as exc:
            self.stats.add(lookup_failures=1)
            logger.warning("kvcodec: %s: %s", failure, exc)
        return None

    def _resolve(self, prefixes: list[str]) -> list[Ref | None] | None:
        """Per whole-block prefix, its ref if one is stored and every object it names is (two store calls);
        None when the store did not answer (counted: a miss).

        A ref whose object is gone while the tail stored under the ref's own
        prefix (exactly its tokens) is not, leads to that tail: the same
        existence check asks for both.
        """
        blobs = self._ask_store(lambda: self.store.get_many([ref_key(self.namespace, h) for h in prefixes]),
                                "reading block refs failed, computing those blocks instead")
        if blobs is None:
            return None
        refs = [parse_ref(b, h, self.chunk) for b, h in zip(blobs, prefixes)]
        self.stats.add(refs_read=sum(b is not None for b in blobs), refs_invalid=sum(
            b is not None and r is None for b, r in zip(blobs, refs)))
        own = {h: Ref(h, r.prefix_tokens, r.prefix_tokens) for h, r in zip(prefixes, refs)
               if r is not None and r.chunk_hash != h}
        targets = list(dict.fromkeys([r.chunk_hash for r in refs if r is not None] + list(own)))
        held = dict(zip(targets, self._stored(targets) or [False] * len(targets))) if targets else {}
        out = []
        for h, r in zip(prefixes, refs):
            if r is not None and not held[r.chunk_hash] and h in own and held[h]:
                self.stats.add(refs_to_own_tail=1)  # the object it named is gone, the tail under its prefix is not
                r = own[h]
            out.append(r if r is not None and held[r.chunk_hash] else None)
        return out

    # ---- load planning --------------------------------------------------------------
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = [list(g) for g in blocks.get_block_ids()]
        if num_external_tokens <= 0:
            return
        start = tracked.local_tokens
        numbered = self._chunk_loads(tracked, start, start + num_external_tokens)
        chunks = list(numbered.values())
        first_tokens = {c.chunk_hash: max(start, n * self.chunk) for n, c in numbered.items()}  # where eviction starts
        busy = [c.chunk_hash for c in chunks]
        if tracked.tail is not None and chunks and chunks[-1].chunk_hash == tracked.tail.chunk_hash:  # also busy under
            # its position (see _reads_inflight)
            busy.append(tail_position(self.namespace, tracked.hashes[: tracked.tail.index], tracked.identity))
        writes = [{s // bs for c in chunks for s in c.spans[g].slots} for g, bs in enumerate(self.block_sizes)]
        load_id = self.ledger.start(request.request_id, busy, first_tokens, tracked.block_ids, writes)
        tracked.loads.add(load_id)
        self._pending_loads.append(LoadSpec(request.request_id, chunks, is_async=self.config.load_mode == "async",
                                            load_id=load_id, adapter=tracked.adapter))
        self.events.loading(load_id, request, chunks, tracked.hashes, tracked.tail, self.chunk)

    def _chunk_loads(self, tracked: _Tracked, start: int, end: int) -> dict[int, ChunkLoad]:
        """Per chunk of ``[start, end)`` (by its number), each group's allocated blocks there (a window group's
        window only); chunks with none are left out, so the loads' positions are not their chunks' numbers."""
        loads = {}
        tail = tracked.tail
        for c in range(start // self.chunk, -(-end // self.chunk)):
            a, b = max(start, c * self.chunk), min(end, (c + 1) * self.chunk)
            spans = [self._span(table, bs, a, b, c * self.chunk) for table, bs in zip(tracked.block_ids, self.block_sizes)]
            blocks = sorted({s // bs for span, bs in zip(spans, self.block_sizes) for s in span.slots})
            if not blocks:  # nothing to write: a chunk left of every window group's window (all-window models)
                continue
            expect = self._digests(tracked, c, b - c * self.chunk)
            if tail is not None and c == tail.index:  # the load ends in the blocks found after the hit chunks
                held = tail.stored_tokens
                loads[c] = ChunkLoad(tail.chunk_hash, spans, blocks, object_tokens=held if held < self.chunk else None,
                                     expect=expect)
            else:
                loads[c] = ChunkLoad(tracked.hashes[c], spans, blocks, expect=expect)
        return loads

    def _digests(self, tracked: _Tracked, index: int, tokens: int) -> TokenDigests:
        """The digests of this request's first ``tokens`` of chunk ``index`` (rounded up to whole digests) that an
        object loaded or saved there must record (see keys/token_digests.py)."""
        unit = self.digest_unit
        tokens = min(-(-tokens // unit) * unit, (tracked.request.num_tokens - index * self.chunk) // unit * unit)
        return token_digests(self.namespace, tracked.request.all_token_ids, self._hashes(tracked, index), tokens, unit,
                             tracked.identity)

    @staticmethod
    def _span(table: list[int], block_size: int, a: int, b: int, chunk_start: int) -> Span:
        """Tokens ``[a, b)`` in this group's non-null blocks: a suffix (vLLM nulls a window group's blocks from the left)."""
        first = a
        while first < b and table[first // block_size] == 0:
            first = (first // block_size + 1) * block_size
        first = min(first, b)
        slots = slots_for_tokens(table, block_size, first, b).tolist()
        return Span(first - chunk_start, slots)

    # ---- per step -------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCodecMetadata:
        idle = not scheduler_output.total_num_scheduled_tokens
        self.keep_stepping.step(idle)
        if self.lookups is not None:
            self.lookups.flush(ran=not idle)  # the step's lookups, one batch, answered while the step runs
            if idle and self.lookups.in_flight():
                # Nothing runs, so waiting costs no request; without it vLLM steps again at once, and its loop
                # spins on the GIL the lookup thread needs between its store calls.
                self.lookups.wait_idle(LOOKUP_IDLE_WAIT_S)
        meta = KVCodecMetadata(loads=self._pending_loads, idle=idle, settled_loads=self._settled)
        self._pending_loads, self._settled = [], {}
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if (tracked := self._requests.get(req_id)) is not None:
                tracked.looked_up = False  # its blocks are gone; the store may hold more by its resumption
        if self._prefetches:
            self._plan_prefetches(meta, scheduler_output)
        self._update_blocks(scheduler_output)
        if self.config.save:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                meta.saves.extend(self._plan_saves(req_id, n))
        meta.saves.extend(self._finishing)
        meta.finishing, self._finishing = [s.req_id for s in self._finishing], []
        return meta

    def _plan_prefetches(self, meta: KVCodecMetadata, out: "SchedulerOutput") -> None:
        """Ask the worker to fetch ahead the hits of requests still waiting after their lookup, and to drop what it
        fetched for requests that were scheduled (their load took what it could), preempted or ended."""
        scheduled = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.req_ids)
        scheduled |= set(getattr(out, "preempted_req_ids", None) or ())
        for req_id in list(self._to_prefetch):
            tracked = self._requests.get(req_id)
            if tracked is None or req_id in scheduled or not tracked.looked_up:
                del self._to_prefetch[req_id]
                continue
            if tracked.block_ids:  # allocated (an async load in flight): nothing to fetch ahead
                del self._to_prefetch[req_id]
                continue
            hit = min(tracked.hit_chunks, self.ledger.first_failed(tracked.hashes[: tracked.hit_chunks]))
            chunks = tracked.hashes[:hit] + ([tracked.tail.chunk_hash] if self._usable_tail(tracked, hit) else [])
            del self._to_prefetch[req_id]
            if chunks:
                meta.prefetches.append(PrefetchSpec(req_id, chunks))
                tracked.prefetching = True
        for req_id in scheduled:
            if (tracked := self._requests.get(req_id)) is not None and tracked.prefetching:
                tracked.prefetching = False
                self._prefetch_done.append(req_id)
        meta.prefetch_done, self._prefetch_done = self._prefetch_done, []

    def _update_blocks(self, out: "SchedulerOutput") -> None:
        for new in out.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(g) for g in new.block_ids]
                tracked.computed = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                tracked.block_ids = [list(g) for g in new_ids]  # a resumed request gets all its blocks anew
            elif new_ids is not None:
                for table, added in zip(tracked.block_ids, new_ids):
                    table.extend(added)
            tracked.computed = cached.num_computed_tokens[i]

    def _plan_saves(self, req_id: str, scheduled: int) -> list[SaveSpec]:
        """Every chunk that is full once this step has run: its tokens are known and its KV written.

        While the store is known to be down nothing is planned (no gather, no
        encode for a put that would fail): the chunks stay due, and are saved
        once it answers if the request still holds them, or by the next
        request that computes them.
        """
        tracked = self._requests.get(req_id)
        if tracked is None or tracked.identity is None or self._awaiting_identity:
            return []
        full = min(tracked.computed + scheduled, tracked.request.num_tokens) // self.chunk
        if self.store.is_down:
            new = set(range(tracked.next_save, full)) - tracked.deferred
            tracked.deferred |= new
            self.stats.add(saves_deferred_store_down=len(new))
            return []
        hashes = self._hashes(tracked, full)
        saves = []
        for c in range(tracked.next_save, full):
            if tracked.save_attempts[c] >= MAX_SAVE_ATTEMPTS or c in tracked.awaiting_room:
                continue
            if not self.claims.claim(hashes[c]):
                self._wait_for(tracked, hashes[c])
                continue
            if not self._blocks_held(tracked, c):
                self.claims.release(hashes[c])  # whoever computes it next saves it
                self.stats.add(saves_dropped_window_freed=1)  # a window group freed them: a retry cannot gather it
                continue
            tracked.save_attempts[c] += 1
            saves.append(self._save_spec(tracked, hashes[c], c * self.chunk, self.chunk, self._refs(tracked, c, self.chunk)))
        tracked.next_save = max(tracked.next_save, full)
        if self.config.block_hits and not tracked.tail_planned and tracked.computed + scheduled >= tracked.request.num_prompt_tokens:
            saves.extend(self._plan_tail(tracked))
        return saves

    def _wait_for(self, tracked: _Tracked, chunk_hash: str) -> None:
        """Leave the chunk to the request saving it, but hear if that save does not land (see _save_settled)."""
        self.stats.add(saves_deduplicated=1)
        tracked.waiting_on.add(chunk_hash)
        self._waiters.setdefault(chunk_hash, set()).add(tracked.request.request_id)

    def _save_spec(self, tracked: _Tracked, chunk_hash: str, first: int, tokens: int,
                   refs: list[tuple[str, int]]) -> SaveSpec:
        slots = [slots_for_tokens(table, bs, first, first + tokens).tolist() for table, bs in zip(tracked.block_ids, self.block_sizes)]
        self.events.saving(tracked.request, chunk_hash, first, tokens)
        self.ledger.rest(tracked.loads, tracked.request.request_id, chunk_hash)  # dropped if one of them fails
        return SaveSpec(tracked.request.request_id, chunk_hash, slots, sorted(tracked.loads), refs,
                        self._digests(tracked, first // self.chunk, tokens), tracked.adapter)

    def _refs(self, tracked: _Tracked, index: int, tokens: int) -> list[tuple[str, int]]:
        """The whole-block prefixes of an object of ``tokens`` tokens at chunk ``index`` (block_hits; see
        keys/block_refs.py): what a prompt sharing only those blocks looks up."""
        if not self.config.block_hits or tracked.identity is None:
            return []
        return prefix_hashes(self.namespace, tracked.request.all_token_ids, tracked.hashes[:index], tokens,
                             self.cache_groups.hit_alignment, tracked.identity)

    def _plan_tail(self, tracked: _Tracked) -> list[SaveSpec]:
        """The prompt's tail, in the step that computes its last token: whole blocks past its last full chunk up to
        the block holding that token (what a replay of the prompt can load), if it has any and it was not loaded."""
        tracked.tail_planned = True
        align = self.cache_groups.hit_alignment
        index, tokens = divmod((tracked.request.num_prompt_tokens - 1) // align * align, self.chunk)
        if not tokens or tracked.save_attempts[TAIL] >= MAX_SAVE_ATTEMPTS or TAIL in tracked.awaiting_room:
            return []
        if (index + 1) * self.chunk <= tracked.request.num_prompt_tokens:
            return []  # its chunk is full, saved as a chunk: that chunk's refs name these blocks
        chunk_hash = tail_hash(self.namespace, tracked.request.all_token_ids, self._hashes(tracked, index), tokens,
                               tracked.identity)
        if tracked.tail is not None and tracked.tail.index == index and tracked.tail.tokens >= tokens:
            return []  # it came from the store: its blocks have a ref (that is how it was found)
        if not self.claims.claim(chunk_hash):
            tracked.tail_save = chunk_hash  # another request's save of the same tail: planned again if it fails
            self._wait_for(tracked, chunk_hash)
            return []
        if not self._blocks_held(tracked, index, tokens):
            self.claims.release(chunk_hash)
            self.stats.add(saves_dropped_window_freed=1)
            return []
        tracked.save_attempts[TAIL] += 1
        tracked.tail_save = chunk_hash
        self.stats.add(tail_saves_planned=1)
        return [self._save_spec(tracked, chunk_hash, index * self.chunk, tokens, self._refs(tracked, index, tokens))]

    def _blocks_held(self, tracked: _Tracked, chunk: int, tokens: int | None = None) -> bool:
        """Whether every group still holds chunk ``chunk``'s blocks in this step (a window group frees those below it).

        ``chunk_size <= sliding_window`` makes this true for a chunk completed in
        this step; it is false for a retry of an older chunk whose blocks vLLM
        may have handed to another request already.
        """
        start, end = chunk * self.chunk, chunk * self.chunk + (tokens or self.chunk)
        for g, table in enumerate(tracked.block_ids):
            bs = self.block_sizes[g]
            if start < self.cache_groups.freed_below(g, tracked.computed):
                return False
            if 0 in table[start // bs : end // bs]:
                return False
        return True

    # ---- outcomes -------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self.kv_cache_manager = kv_cache_manager

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, KVCodecWorkerReport):
            return
        if report.adapters:
            self._adapters_loaded(report.adapters)
        for req_id, outcome in report.loads.items():
            self._load_settled(req_id, outcome)
        for save in report.saves:
            if not save.load_failed:  # one of its loads failed: settled with that load (see _drop_resting)
                self._save_settled(save)
        if report.save_room is not None:
            self._room_freed(report.save_room)
        self.keep_stepping.reported(report.background)

    def _adapters_loaded(self, loads: dict[int, str]) -> None:
        """The workers (re)loaded these LoRA adapters: later requests are keyed by the files they read. A request
        keyed by other weights is cached no further, a streaming session's later turns included: its KV so far
        may come from either (the workers would refuse its loads and saves anyway)."""
        self.adapters.adopt(loads)
        for tracked in self._requests.values():
            if tracked.adapter is not None and loads.get(tracked.adapter[0], tracked.adapter[1]) != tracked.adapter[1]:
                tracked.identity, tracked.adapter, tracked.adapter_reloaded = None, None, True

    def _load_settled(self, req_id: str, outcome: LoadOutcome) -> None:
        """Settle the load the outcome names (``load_id``) once every worker that runs it reported (a rank that
        ends it steps after another is heard then, with the same load): the request now bearing ``req_id`` may
        be a new one, whose own load stays in flight and whose hit this outcome says nothing about."""
        settled = self.ledger.report(outcome)
        if settled is None:
            return  # some worker still runs it: still in flight, and its outcome still untold
        load, outcome = settled
        if outcome.load_id:
            self._settled[outcome.load_id] = bool(outcome.failed)  # the saves held for it are stored, or dropped
        tracked = self._requests.get(req_id)
        if tracked is not None and outcome.load_id in tracked.loads:
            tracked.loads.discard(outcome.load_id)
        else:
            tracked = None  # gone, or a new request under the id of the one whose load this was
        self.events.load_settled(outcome)
        if not outcome.failed:
            return
        self.ledger.mark_failed(outcome.failed)
        for h in outcome.failed:
            self.claims.release(h)  # whoever computes it next saves it again
        if load is not None:
            self._drop_resting(load.resting)
        self.stats.add(failed_load_chunks=len(outcome.failed))
        if load is not None:
            self._evict_from(load.block_ids, min(load.first_tokens.get(h, 1 << 62) for h in outcome.failed))
        if tracked is not None:
            tracked.failures_seen += 1
            chunks = [tracked.hashes.index(h) for h in outcome.failed if h in tracked.hashes]
            if tracked.tail is not None and tracked.tail.chunk_hash in outcome.failed:
                tracked.tail, tracked.tail_planned = None, False  # recomputed, then saved anew
            elif not chunks:
                chunks = [0]  # failed hashes it does not know: trust none of its chunks
            if chunks:
                tracked.hit_chunks = min(tracked.hit_chunks, min(chunks))
                tracked.next_save = min(tracked.next_save, min(chunks))

    def _drop_resting(self, saves: list[RestingSave]) -> None:
        """The saves planned while this load was unsettled were computed over KV that did not arrive on some worker:
        every worker drops them (its own failure, or the verdict of ``settled_loads``), unwritten. Settle them now,
        as saves that did not land (claims released, planned again from the recompute), so the recompute saves
        them instead of deduplicating against them; the workers' reports of those drops are then ignored."""
        for save in saves:
            if not save.settled:
                save.settled = True
                self._save_settled(SaveOutcome(save.req_id, save.chunk_hash, landed=False, load_failed=True))

    def _evict_from(self, block_ids: list[list[int]], first_token: int) -> None:
        """Take every group's blocks from ``first_token`` on out of vLLM's prefix cache (they keep their refcounts).

        They held KV that failed to arrive, or KV computed after it: never a
        local hit, whether the request recomputes them or ends first.
        """
        blocks = {b for table, bs in zip(block_ids, self.block_sizes) for b in table[first_token // bs :] if b != 0}
        if blocks and self.kv_cache_manager is not None:
            self.kv_cache_manager.evict_blocks(blocks)
            self.stats.add(blocks_evicted_after_load_failure=len(blocks))

    def _save_settled(self, save: SaveOutcome) -> None:
        self.events.save_settled(save)
        waiters = self._waiters.pop(save.chunk_hash, set())
        if save.landed:
            self.ledger.replaced(save.chunk_hash)
            return
        self.claims.release(save.chunk_hash)
        # Requests that skipped the chunk for this save and still hold it save it instead: the one that claimed it
        # may have finished before its save failed (a burst's first request, an outage's last).
        for req_id in waiters - {save.req_id}:
            if (waiter := self._requests.get(req_id)) is not None:
                waiter.waiting_on.discard(save.chunk_hash)
                self._replan(waiter, save.chunk_hash, 0)
        tracked = self._requests.get(save.req_id)
        if tracked is not None:
            self._replan(tracked, save.chunk_hash, save.needs_room, spent=not save.load_failed)

    def _replan(self, tracked: _Tracked, chunk_hash: str, needs_room: int, spent: bool = True) -> None:
        """Plan a save of one of ``tracked``'s chunks again, now or (``needs_room``) once the queue has room;
        ``spent``: it counts as one of the chunk's attempts (a put that failed)."""
        if chunk_hash in tracked.hashes:
            chunk = tracked.hashes.index(chunk_hash)
        elif chunk_hash == tracked.tail_save:
            chunk = TAIL
        else:
            return
        if needs_room or not spent:
            # Not a failed save (no room, or computed over a failed load: the recompute saves it): its attempt is
            # given back. Under async scheduling the room a report brings was taken a step before the saves already
            # planned for the next step, so a save planned from it can find the queue full again; spending attempts
            # on that gave chunks up for good (seen: 3 of 3 spent).
            tracked.save_attempts[chunk] = max(0, tracked.save_attempts[chunk] - 1)
        if needs_room:
            tracked.awaiting_room[chunk] = max(needs_room, tracked.awaiting_room.get(chunk, 0))
            self._awaiting_room.setdefault(tracked.request.request_id)
        else:
            self._plan_again(tracked, chunk)

    @staticmethod
    def _plan_again(tracked: _Tracked, chunk: int) -> None:
        """Still holding the chunk's blocks: plan its save again next step (bounded by MAX_SAVE_ATTEMPTS)."""
        if chunk == TAIL:
            tracked.tail_planned = False
        else:
            tracked.next_save = min(tracked.next_save, chunk)

    def _room_freed(self, room: int) -> None:
        """Plan again, oldest first, the saves dropped for want of queue room that the room now holds.

        Retrying them every step would spend their few attempts within
        milliseconds, long before a put drains the queue; they wait for a
        report whose room covers them instead (the room is a snapshot taken
        after every outcome it travels with, so none waits for a freeing that
        has already happened), and only as many as it holds are planned.
        """
        for req_id in list(self._awaiting_room):
            tracked = self._requests.get(req_id)
            for chunk, needed in list(tracked.awaiting_room.items()) if tracked is not None else []:
                if needed > room:
                    return
                room -= needed
                del tracked.awaiting_room[chunk]
                self._plan_again(tracked, chunk)
            del self._awaiting_room[req_id]

    # ---- end ------------------------------------------------------------------------
    def request_finished(self, request: "Request") -> bool:
        """Forget the request; True when vLLM must hold its blocks until its finishing tail is gathered."""
        tracked = self._requests.pop(request.request_id, None)  # its load, if in flight, stays in the ledger
        self._awaiting_room.pop(request.request_id, None)
        if self.lookups is not None:
            self.lookups.forget(request.request_id)  # finished or aborted before its answer: nobody waits for it
        self._to_prefetch.pop(request.request_id, None)
        if tracked is not None and tracked.prefetching:
            self._prefetch_done.append(request.request_id)  # the worker drops what it fetched ahead (next plan)
        for chunk_hash in tracked.waiting_on if tracked is not None else ():
            waiters = self._waiters.get(chunk_hash)
            if waiters is not None:
                waiters.discard(request.request_id)
                if not waiters:
                    del self._waiters[chunk_hash]
        return tracked is not None and self._plan_finish(tracked)

    def _plan_finish(self, tracked: _Tracked) -> bool:
        """The finishing tail: prompt and answer past their last full chunk, whole blocks up to the last token's.

        What vLLM's own cache keeps of a finished request, and what the next
        turn of a chat shares; the full chunks of the answer were saved as
        they filled. Only for a request that ended by a stop or its length
        (an aborted one may have KV of unfinished steps), whose blocks hold KV
        that no failed load touched. vLLM holds the blocks until the worker
        reports the request as finished sending, after gathering the tail in
        the next step (its ``delay_free_blocks`` contract).
        """
        request = tracked.request
        if (not (self.config.save and self.config.block_hits) or tracked.identity is None or self._awaiting_identity
                or self.store.is_down or not tracked.block_ids or tracked.failures_seen
                or request.status not in _finished_whole()):
            return False
        align = self.cache_groups.hit_alignment
        index, tokens = divmod((request.num_tokens - 1) // align * align, self.chunk)
        if not tokens or (tracked.tail is not None and tracked.tail.index == index and tracked.tail.tokens >= tokens):
            return False  # whole chunks only (saved as they filled), or loaded: their refs name these blocks
        chunk_hash = tail_hash(self.namespace, request.all_token_ids, self._hashes(tracked, index), tokens,
                               tracked.identity)
        if chunk_hash == tracked.tail_save or not self.claims.claim(chunk_hash):
            return False  # the prompt's tail (an answer of no whole block), or another request saves it
        if not self._blocks_held(tracked, index, tokens):
            self.claims.release(chunk_hash)
            return False
        self._finishing.append(self._save_spec(tracked, chunk_hash, index * self.chunk, tokens,
                                               self._refs(tracked, index, tokens)))
        self.stats.add(finish_tail_saves_planned=1)
        return True

    def forget_store(self) -> None:
        """Forget what this instance learnt of the store: the chunks it saved (claims) and those whose loads failed.
        The next request then looks every chunk up and saves what it computes, as a fresh instance would."""
        self.claims = SaveClaims()
        self.ledger.forget_failures()

    def state(self) -> dict[str, Any]:
        """What is held between steps (tests check it is empty once the engine is)."""
        return {"requests": list(self._requests), "pending_loads": len(self._pending_loads),
                "inflight_loads": self.ledger.inflight_requests(), "awaiting_room": list(self._awaiting_room),
                "waiters": list(self._waiters), "lookups": self.lookups.waiting() if self.lookups else [],
                "prefetches": list(self._to_prefetch), "finishing": [s.req_id for s in self._finishing]}

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.shutdown()
        self.store.close()
