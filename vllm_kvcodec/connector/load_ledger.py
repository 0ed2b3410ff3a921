"""What the scheduler half knows about loads beyond one request: chunks in flight and chunks that failed.

Two facts outlive the request that learnt them:

- **In flight.** From the step a load is planned until the worker reports its
  outcome, the chunk's blocks hold KV that may never arrive. vLLM registers a
  synchronous load's blocks in its prefix cache at allocation, so another
  request could take them as a local hit in the same step; an asynchronous
  load's blocks are not registered until it lands, so another request would
  fetch the same chunk again. Either way the other request should wait for
  the outcome (vLLM's OffloadingConnector answers ``None`` the same way), and
  then hits locally, or loads or computes what failed.
- **Failed.** A chunk whose object was missing, damaged or late must not be
  planned again on the strength of a lookup made before the failure, or an
  async request would be rewound and handed the same failing load forever.
  Lookups stop before a failed chunk until a save of it lands (the next
  request that computes it replaces the object) or ``FAILED_TTL_S`` passes
  (another instance may have replaced it).

Entries in flight also expire, so a lost report can delay requests but never
stall them.

Every worker runs every load (each tensor-parallel rank of each pipeline
stage, its own objects; a replicated latent's ranks all load the one object),
and an async load may end on one rank steps before another: a load is settled
only once all of them reported (:meth:`LoadLedger.report`, counting them as
vLLM's ``KVOutputAggregator`` counts their ``finished_recving``), with their
outcomes merged (failed where any failed). Until then it stays in flight: the
rank still loading may still write its blocks, and its failure must be
settled, and counted, with the load (the request's failed loads decide which
of its saves the workers keep). A load that expires keeps counting its reports
(no longer busy) until the last one arrives, within ``MAX_EXPIRED`` loads.

Each load has its own id (:meth:`LoadLedger.start` returns it; the plan
carries it and the worker's outcome echoes it), because request ids are not
unique over time: vLLM randomizes them by default, but a user may fix them
(``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), and a request aborted while its
load failed can be followed by a new request of the same id before that
failure is reported. The late report must settle the load it is about (and
evict *its* blocks), not the load of the request that now bears the id.

A load in flight is known two ways: by the chunk keys it writes (what the
asking request's own chain is compared with), and by the blocks it writes
per KV cache group (what the asking request's *local hit* is compared with:
vLLM's prefix cache is block-granular, so a prompt that diverges inside a
chunk has another key for it, yet may be handed the loading request's blocks
of that chunk up to where it diverges).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from vllm_kvcodec.plans.outcomes import LoadOutcome

#: A failed chunk is skipped by lookups for this long unless a save of it lands first.
FAILED_TTL_S = 60.0
#: Expired loads kept to count their late reports (oldest dropped beyond it: at worst a late report is settled alone).
MAX_EXPIRED = 1024


@dataclasses.dataclass
class InflightLoad:
    """One planned load, kept until the worker reports it (even if its request ends first)."""

    req_id: str
    chunk_hashes: list[str]
    first_tokens: dict[str, int]  # chunk hash -> first token of the request this load writes
    block_ids: list[list[int]]  # the request's block tables (one per KV cache group) when the load was planned
    writes: list[set[int]]  # per KV cache group, the blocks the load writes
    expires: float
    heard: LoadOutcome | None = None  # the outcomes of the workers that reported it so far, merged
    resting: list["RestingSave"] = dataclasses.field(default_factory=list)  # saves planned before it settled


@dataclasses.dataclass
class RestingSave:
    """A save planned while loads of its request were unsettled: if one of them fails, the chunk was computed over
    missing KV, and the workers drop it (``settled`` once the scheduler half has acted on that, for all its loads)."""

    req_id: str
    chunk_hash: str
    settled: bool = False


class Settled(NamedTuple):
    """A load every worker reported: what it was (None: not known here), and all their outcomes merged."""

    load: InflightLoad | None
    outcome: LoadOutcome


class LoadLedger:
    def __init__(self, inflight_ttl_s: float, failed_ttl_s: float = FAILED_TTL_S, loaders: int = 1) -> None:
        self.inflight_ttl_s, self.failed_ttl_s = inflight_ttl_s, failed_ttl_s
        self.loaders = loaders  # workers that run each load and report it
        self._next_id = 1  # 0 is no load
        self._inflight: dict[int, InflightLoad] = {}  # load id -> the load
        self._expired: dict[int, InflightLoad] = {}  # load id -> a load past its TTL some workers have not reported
        self._busy: dict[str, int] = {}  # chunk hash -> loads in flight that carry it
        self._writing: list[dict[int, int]] = []  # per KV cache group: block id -> loads in flight that write it
        self._failed: dict[str, float] = {}  # chunk hash -> when its failure was reported

    # ---- in flight ------------------------------------------------------------------
    def start(self, req_id: str, chunk_hashes: list[str], first_tokens: dict[str, int], block_ids: list[list[int]],
              writes: Sequence[Iterable[int]] = ()) -> int:
        """A load was planned: its id, which its plan and its outcome carry."""
        load_id, self._next_id = self._next_id, self._next_id + 1
        load = InflightLoad(req_id, list(chunk_hashes), first_tokens, [list(t) for t in block_ids],
                            [set(g) for g in writes], time.monotonic() + self.inflight_ttl_s)
        self._inflight[load_id] = load
        for h in load.chunk_hashes:
            self._busy[h] = self._busy.get(h, 0) + 1
        while len(self._writing) < len(load.writes):
            self._writing.append({})
        for writing, blocks in zip(self._writing, load.writes):
            for b in blocks:
                writing[b] = writing.get(b, 0) + 1
        return load_id

    def rest(self, load_ids: Iterable[int], req_id: str, chunk_hash: str) -> None:
        """A save of ``chunk_hash`` was planned while loads ``load_ids`` were unsettled: each carries it until then."""
        save = RestingSave(req_id, chunk_hash)
        for load_id in load_ids:
            if (load := self._inflight.get(load_id) or self._expired.get(load_id)) is not None:
                load.resting.append(save)

    def next_id(self) -> int:
        """The id the next load will get: every load planned from now on has this id or a higher one."""
        return self._next_id

    def report(self, outcome: LoadOutcome) -> Settled | None:
        """Workers' outcome of load ``outcome.load_id`` (``outcome.ranks`` of them, as vLLM merged one step's).

        None while some worker has not reported: the load stays as it was
        (in flight, unless it expired). Once all did: the load, forgotten,
        and every worker's outcome merged. An outcome of a load not known
        here (id 0, or dropped long after it expired) is all there is.
        """
        load = self._inflight.get(outcome.load_id) or self._expired.get(outcome.load_id)
        if load is None:
            return Settled(None, outcome)
        heard = outcome if load.heard is None else load.heard.merge(outcome)
        if heard.ranks < self.loaders:
            load.heard = heard
            return None
        self.settle(outcome.load_id)
        self._expired.pop(outcome.load_id, None)
        return Settled(load, heard)

    def settle(self, load_id: int) -> InflightLoad | None:
        """Load ``load_id`` has an outcome (or will never have one): forget it, return what it was."""
        load = self._inflight.pop(load_id, None)
        if load is not None:
            _release(self._busy, load.chunk_hashes)
            for writing, blocks in zip(self._writing, load.writes):
                _release(writing, blocks)
        return load

    def busy(self, chunk_hashes: Iterable[str]) -> bool:
        """Whether any of these chunks is being loaded by some request right now."""
        self._expire_inflight()
        return any(h in self._busy for h in chunk_hashes)

    def writing_any(self) -> bool:
        """Whether some load in flight writes blocks (then a local hit may include some of them)."""
        self._expire_inflight()
        return any(self._writing)

    def writes_any(self, block_ids: Sequence[Iterable[int]]) -> bool:
        """Whether a load in flight writes any of these blocks (one iterable per KV cache group)."""
        self._expire_inflight()
        return any(b in writing for writing, blocks in zip(self._writing, block_ids) for b in blocks)

    def inflight_requests(self) -> list[str]:
        return [load.req_id for load in self._inflight.values()]

    def _expire_inflight(self) -> None:
        now = time.monotonic()
        for load_id in [i for i, load in self._inflight.items() if load.expires <= now]:
            self._expired[load_id] = self.settle(load_id)  # no longer busy; still counting its reports
        while len(self._expired) > MAX_EXPIRED:
            del self._expired[next(iter(self._expired))]

    # ---- failed ---------------------------------------------------------------------
    def mark_failed(self, chunk_hashes: Iterable[str]) -> None:
        now = time.monotonic()
        for h in chunk_hashes:
            self._failed[h] = now

    def replaced(self, chunk_hash: str) -> None:
        """A save of ``chunk_hash`` landed: its object is whole again."""
        self._failed.pop(chunk_hash, None)

    def forget_failures(self) -> None:
        self._failed.clear()

    def first_failed(self, chunk_hashes: Sequence[str]) -> int:
        """Index of the first chunk known to fail, or ``len(chunk_hashes)``."""
        if self._failed:
            cutoff = time.monotonic() - self.failed_ttl_s
            for h in [h for h, t in self._failed.items() if t <= cutoff]:
                del self._failed[h]
        for i, h in enumerate(chunk_hashes):
            if h in self._failed:
                return i
        return len(chunk_hashes)

    def is_idle(self) -> bool:
        return not self._inflight and not self._busy and not any(self._writing)


def _release(counts: dict, keys: Iterable) -> None:
    """One load fewer holds each of ``keys``."""
    for k in keys:
        left = counts.get(k, 0) - 1
        if left > 0:
            counts[k] = left
        else:
            counts.pop(k, None)
