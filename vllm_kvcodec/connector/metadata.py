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

from vllm_kvcodec.outcomes import LoadOutcome, SaveOutcome

__all__ = ["ChunkLoad", "KVCodecMetadata", "KVCodecWorkerReport", "LoadOutcome", "LoadSpec", "SaveOutcome", "SaveSpec"]


@dataclasses.dataclass
class ChunkLoad:
    """One stored chunk to bring into paged memory.

    ``slots`` are the paged slots of the chunk's tokens from ``first_token``
    (tokens before it are already in vLLM's local prefix cache, in blocks other
    requests may share, and are never written).
    """

    chunk_hash: str
    first_token: int
    slots: list[int]
    block_ids: list[int]


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool


@dataclasses.dataclass
class SaveSpec:
    """One full chunk computed by this step (or earlier), to gather and store.

    ``failures_seen`` is how many failed loads of this request the scheduler
    half had heard of when it planned the save: a worker that knows of more
    (a load failed in a step the plan did not yet know about, as with vLLM's
    async scheduling) drops the save, because the chunk may have been computed
    over KV that never arrived.
    """

    req_id: str
    chunk_hash: str
    slots: list[int]
    failures_seen: int = 0


@dataclasses.dataclass
class KVCodecMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KVCodecWorkerReport(KVConnectorWorkerMetadata):
    """Outcomes since the last report; a load counts as failed if it failed on any worker."""

    loads: dict[str, LoadOutcome] = dataclasses.field(default_factory=dict)
    saves: list[SaveOutcome] = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVCodecWorkerReport":
        assert isinstance(other, KVCodecWorkerReport)
        loads = dict(self.loads)
        for req_id, outcome in other.loads.items():
            loads[req_id] = loads[req_id].merge(outcome) if req_id in loads else outcome
        return KVCodecWorkerReport(loads, self.saves + other.saves)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)
