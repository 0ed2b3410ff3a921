"""How a load or a save ended, as the worker reports it to the scheduler half.

Plain data without vLLM, so the load path (which the GPU check runs without
vLLM) can produce it; :mod:`~.metadata` carries it across processes.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LoadOutcome:
    """How one request's load ended: chunk hashes in place, and chunk hashes that failed (any layer group, any rank).

    ``load_id`` echoes the plan's (:class:`~vllm_kvcodec.connector.metadata.LoadSpec`): a request id may come
    back for a new request before an aborted one's outcome arrives, and the outcome must settle its own load.

    ``ranks``: how many workers' outcomes of the load this one holds (each worker reports 1; merging adds
    them up). Every worker (each tensor-parallel rank of each pipeline stage) runs every load, and they need
    not finish it in the same step: the scheduler half settles a load once all of them reported
    (:meth:`~vllm_kvcodec.connector.load_ledger.LoadLedger.report`), as vLLM's ``KVOutputAggregator``
    counts their ``finished_recving``.
    """

    loaded: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    load_id: int = 0  # 0: not told
    ranks: int = 1

    def merge(self, other: "LoadOutcome") -> "LoadOutcome":
        """Both outcomes of one load: failed where it failed on any worker."""
        failed = list(dict.fromkeys(self.failed + other.failed))
        loaded = [h for h in dict.fromkeys(self.loaded + other.loaded) if h not in failed]
        return LoadOutcome(loaded, failed, self.load_id or other.load_id, self.ranks + other.ranks)


@dataclasses.dataclass(frozen=True)
class SaveOutcome:
    req_id: str
    chunk_hash: str
    landed: bool  # False: dropped or failed (counted on the worker with its reason)
    #: > 0: dropped because the save queue had no room for this many bytes. Planning it again only helps once
    #: the queue has drained that much, which takes a put (tens of ms or more), not a step (a few ms).
    needs_room: int = 0
    #: Dropped because a load it was computed after failed, here or on another worker: the scheduler half settled
    #: it with that load (released its claim, planned it again) and takes no further notice of this report.
    load_failed: bool = False
