"""What the two halves tell each other: plans down (scheduler -> worker), outcomes up (worker -> scheduler).

vLLM pickles both across processes. The plans (:class:`KVCodecMetadata`) say
which stored chunks to load into which slots and which computed chunks to
save; the outcomes (:class:`KVCodecWorkerReport`, returned through
``build_connector_worker_meta`` and aggregated over tensor-parallel workers)
say which loads failed and which saves landed or were dropped, so that the
scheduler half can stop trusting a chunk that failed, keep vLLM from serving
its blocks as a local hit, and plan a save again when one did not land.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_kvcodec.format import TokenDigests
from vllm_kvcodec.outcomes import LoadOutcome, SaveOutcome
from vllm_kvcodec.spans import Span, one_group, one_span

__all__ = ["ChunkLoad", "KVCodecMetadata", "KVCodecWorkerReport", "LoadOutcome", "LoadSpec", "PrefetchSpec", "SaveOutcome",
           "SaveSpec", "Span"]


@dataclasses.dataclass
class ChunkLoad:
    """One stored chunk to bring into paged memory.

    ``spans`` has one :class:`~vllm_kvcodec.spans.Span` per vLLM KV cache
    group: the chunk's tokens from the span's ``first_token`` on, at their
    slots in that group's blocks. Tokens before it are already in vLLM's local
    prefix cache, in blocks other requests may share, and are never written; a
    sliding-window group's span also leaves out the tokens whose blocks vLLM
    did not allocate (outside the window of the hit). ``block_ids`` are every
    block the load writes, of all groups. A prompt tail (``prompt_tails``) is
    an object of fewer tokens than a chunk, as ``object_tokens`` says; a
    load through a block ref (:mod:`~vllm_kvcodec.block_refs`) writes only the
    first of the object's tokens. ``expect``: the digests of this prompt's tokens the object must record
    (:mod:`~vllm_kvcodec.token_digests`), up to the last token the load writes; checked before any write.
    """

    chunk_hash: str
    spans: list[Span]
    block_ids: list[int]
    object_tokens: int | None = None  # tokens the stored object holds: None for a full chunk, fewer for a tail
    expect: TokenDigests | None = None

    @property
    def tokens(self) -> int:
        """Tokens loaded: the longest span (the full-attention groups')."""
        return max((len(s.slots) for s in self.spans), default=0)

    @property
    def first_token(self) -> int:
        return one_span(self.spans).first_token

    @property
    def slots(self) -> list[int]:
        return one_span(self.spans).slots


@dataclasses.dataclass
class LoadSpec:
    """One request's load. ``load_id``: the scheduler half's id of this load, which the worker echoes in its
    :class:`LoadOutcome` (request ids can be reused, see :mod:`~.load_ledger`)."""

    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool
    load_id: int = 0
    adapter: tuple[int, str] | None = None  # LoRA: (adapter id, weights its keys name), which the worker checks


@dataclasses.dataclass
class SaveSpec:
    """One full chunk computed by this step (or earlier), to gather and store.

    ``unsettled_loads`` are the ids of the request's loads whose outcome the
    scheduler half had not heard of (from every worker) when it planned the
    save: the chunk may have been computed over KV that never arrived, on
    this worker or any other (their outputs are all-reduced, or feed the next
    stage). A worker on which one of them failed drops the save at once;
    where other workers run the same loads, the others hold it until the
    scheduler half sends the load's verdict (``KVCodecMetadata.settled_loads``,
    :mod:`~vllm_kvcodec.save.held_saves`). Ids, not a count of failures: a
    rank whose load failed a step after another rank's succeeded is judged by
    the same load, and a new request under a finished one's id never inherits
    its failures.
    """

    req_id: str
    chunk_hash: str
    group_slots: list[list[int]]  # the chunk's slots in each KV cache group's blocks
    unsettled_loads: list[int] = dataclasses.field(default_factory=list)
    # its whole-block prefixes (hash, tokens), whose refs rank 0 writes (block_refs.py)
    refs: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    digests: TokenDigests | None = None  # its tokens, recorded in every object's header (token_digests.py)
    adapter: tuple[int, str] | None = None  # LoRA: (adapter id, weights its key names), which the worker checks

    @property
    def slots(self) -> list[int]:
        return one_group(self.group_slots)

    @property
    def tokens(self) -> int:
        return len(self.group_slots[0])


@dataclasses.dataclass
class PrefetchSpec:
    """The chunks (full ones, and a prompt tail) a lookup found for a request that waits: fetch them ahead."""

    req_id: str
    chunk_hashes: list[str]


@dataclasses.dataclass
class KVCodecMetadata(KVConnectorMetadata):
    """One step's plan. ``idle``: vLLM scheduled no tokens, so the step only polls for finished loads.

    vLLM steps again at once when nothing runs but a request waits for its
    remote KV; without ``idle`` that poll spins on the GIL the fetch threads
    need between their kernels (a 4k-token async load took 13-19 s to a TTFT, 1.9 s with the wait).
    """

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    idle: bool = False
    prefetches: list[PrefetchSpec] = dataclasses.field(default_factory=list)
    prefetch_done: list[str] = dataclasses.field(default_factory=list)  # requests whose prefetched objects go
    # finished requests whose blocks vLLM holds for their finishing tail (in ``saves``): the worker reports them
    # as finished sending once it has gathered it, and vLLM frees their blocks
    finishing: list[str] = dataclasses.field(default_factory=list)
    # loads every worker reported since the last plan (load id -> failed on one of them): the saves held for
    # them (save/held_saves.py) are stored, or dropped
    settled_loads: dict[int, bool] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class KVCodecWorkerReport(KVConnectorWorkerMetadata):
    """Outcomes since the last report; a load counts as failed if it failed on any worker.

    ``loads`` is keyed by request id: a worker reports each load once it ends (a sync load in its own step), and
    vLLM admits a request id again only after the last request of that id is gone (an async load holds it until
    every worker reported its ``finished_recving``), so one report holds at most one load per id. Which load of
    the requests that bore an id over time is each outcome's ``load_id``; how many workers' outcomes of it the
    report holds, its ``ranks`` (the others report it in later steps: the scheduler half waits for them).

    ``save_room``: bytes the fullest worker's save queue could take when the
    report was built (None: no saver). A snapshot, not an event, so it is
    current whatever order the outcomes before it arrived in.

    ``background``: saves and upgrades in flight on the workers that told
    (each tells in every step while it has any, and once when it has none
    left; None: nobody told, so none is in flight): what vLLM keeps an idle
    engine stepping for (see background_work.py).

    ``adapters``: the LoRA adapters the workers loaded, by id, with the
    fingerprint of the files each was read from (see lora_loads.py); "" where
    it is unknown, or where workers read different files.
    """

    loads: dict[str, LoadOutcome] = dataclasses.field(default_factory=dict)
    saves: list[SaveOutcome] = dataclasses.field(default_factory=list)
    save_room: int | None = None
    background: int | None = None
    adapters: dict[int, str] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVCodecWorkerReport":
        assert isinstance(other, KVCodecWorkerReport)
        loads = dict(self.loads)
        for req_id, outcome in other.loads.items():
            loads[req_id] = loads[req_id].merge(outcome) if req_id in loads else outcome
        rooms = [r for r in (self.save_room, other.save_room) if r is not None]
        told = [b for b in (self.background, other.background) if b is not None]
        adapters = dict(self.adapters)
        for lora_id, weights in other.adapters.items():
            adapters[lora_id] = weights if adapters.get(lora_id, weights) == weights else ""
        return KVCodecWorkerReport(loads, self.saves + other.saves, min(rooms) if rooms else None,
                                   sum(told) if told else None, adapters)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.adapters) or self.background is not None
