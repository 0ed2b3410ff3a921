"""What the scheduler half tells the worker half each step (vLLM pickles it across processes)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
    """One full chunk computed by this step (or earlier), to gather and store."""

    req_id: str
    chunk_hash: str
    slots: list[int]


@dataclasses.dataclass
class KVCodecMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
