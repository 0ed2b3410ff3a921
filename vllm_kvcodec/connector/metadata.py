"""What the two halves tell each other, as vLLM carries it: plans down (scheduler -> worker), outcomes up.

The two classes here subclass vLLM's (its connector metadata and worker
metadata); what they carry is plain data from :mod:`vllm_kvcodec.plans`. vLLM
pickles both across processes. The plans (:class:`KVCodecMetadata`) say
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

from vllm_kvcodec.plans.loads import LoadSpec, PrefetchSpec
from vllm_kvcodec.plans.outcomes import LoadOutcome, SaveOutcome
from vllm_kvcodec.plans.saves import SaveSpec
from vllm_kvcodec.save.precision_choice import merge_costs

__all__ = ["KVCodecMetadata", "KVCodecWorkerReport"]


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

    ``read_costs`` (precision auto): the workers' expected seconds per raw
    byte of each precision's loads, where they moved since their last report
    (the slower worker's where several tell; save/precision_choice.py).
    """

    loads: dict[str, LoadOutcome] = dataclasses.field(default_factory=dict)
    saves: list[SaveOutcome] = dataclasses.field(default_factory=list)
    save_room: int | None = None
    background: int | None = None
    adapters: dict[int, str] = dataclasses.field(default_factory=dict)
    read_costs: dict[str, float] | None = None

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
                                   sum(told) if told else None, adapters, merge_costs(self.read_costs, other.read_costs))

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.adapters or self.read_costs) or self.background is not None
