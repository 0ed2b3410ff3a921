"""The load path: fetch -> decode -> scatter, on threads, layer group by layer group; one path for every medium.

Objects are submitted in layer-group order, so the first layers' KV arrives
first and the engine's prefill of the uncached suffix can start on layer 0
while later groups are still on the wire. Store I/O and decoding (numba/zstd
kernels) release the GIL, so threads overlap for real. Memory stays bounded:
each thread holds at most one object.

Per object, whatever the medium: get it (a missing object fails its blocks),
validate its header once (sizes, checksum, the key it is bound to, the shape
this engine expects), then let the :class:`Placement` decode and scatter it.
What differs between host memory and a CUDA device is only the placement
(:class:`HostPlacement` here; :class:`~vllm_kvcodec.load.cuda_placement.CudaPlacement`
stages, copies and decodes on a side stream), the way vLLM's offloading code
keeps one worker contract with a transfer handler per medium.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from storage import Store, StoreError
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import ChunkHeader, decode_payload, read_header
from vllm_kvcodec.keys import ObjectAddresses
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.paged import PagedLayout

if TYPE_CHECKING:  # imports vLLM; the fetcher itself must not (the GPU check runs without it)
    from vllm_kvcodec.connector.metadata import ChunkLoad, LoadSpec
    from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")


def _one_torch_thread() -> None:
    """Parallelism comes from the fetch threads; intra-op threads would fight the engine for cores."""
    torch.set_num_threads(1)


class LoadError(Exception):
    """A stored object could not be used; its blocks are recomputed. ``kind`` names why (a metric label)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def failure_kind(exc: BaseException) -> str:
    """Why an object did not load, as ``vllm:kvcodec_load_failures_total``'s ``kind``: missing, corrupt
    (header, checksum, key binding or payload), mismatch (another shape or dtype), store (the store failed),
    timeout (the load was cancelled past its deadline) or other."""
    if isinstance(exc, LoadError):
        return exc.kind
    if isinstance(exc, ChunkFormatError):
        return "corrupt"
    if isinstance(exc, StoreError):
        return "store"
    return "other"


@dataclasses.dataclass
class Decoded:
    """One object's KV ``[layers, 2, chunk, heads, head]`` and the chunk's slots, where the caches are."""

    kv: torch.Tensor
    slots: torch.Tensor
    on_device: bool = False  # decoded by a device kernel (counted as gpu_decoded_objects)


class Placement(abc.ABC):
    """How one validated object reaches paged memory on one medium."""

    def __init__(self, caches: list[torch.Tensor], layouts: list[PagedLayout]) -> None:
        self.caches, self.layouts = caches, layouts

    def new_job(self, group_layers: list[list[int]], objects_per_group: int, req_ids: list[str]) -> LoadJob:
        return LoadJob(group_layers, objects_per_group, req_ids)

    @abc.abstractmethod
    def decode(self, blob: bytes, header: ChunkHeader, slots: list[int]) -> Decoded:
        """Decode the object (untrusted beyond its header) next to the caches; raise on anything invalid."""

    @abc.abstractmethod
    def scatter(self, layers: range, decoded: Decoded, first_token: int) -> None:
        """Write tokens ``first_token:`` of the decoded object into its slots, layer by layer."""

    def shutdown(self) -> None:
        """Release streams or staging memory, if any."""


class HostPlacement(Placement):
    """Caches in host memory: decode on the fetch thread, scatter with each layer's page layout."""

    def decode(self, blob: bytes, header: ChunkHeader, slots: list[int]) -> Decoded:
        return Decoded(decode_payload(blob, header), torch.tensor(slots, dtype=torch.int64))

    def scatter(self, layers: range, decoded: Decoded, first_token: int) -> None:
        part = decoded.kv[:, :, first_token : first_token + decoded.slots.numel()]
        for i, layer in enumerate(layers):
            self.layouts[layer].scatter(self.caches[layer], decoded.slots, part[i], check=False)


class Fetcher:
    def __init__(
        self,
        store: Store,
        addresses: ObjectAddresses,
        caches: list[torch.Tensor],
        layouts: list[PagedLayout],
        threads: int,
        stats: ConnectorStats,
        observe_transfer: Callable[[int, float], None] | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.store, self.addresses = store, addresses
        self.observe_transfer = observe_transfer  # feeds the link estimate of codec "auto"
        self.groups, self.caches, self.layouts, self.stats = addresses.groups, caches, layouts, stats
        self.placement = placement if placement is not None else HostPlacement(caches, layouts)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcodec-fetch", initializer=_one_torch_thread)

    def submit(self, specs: list[LoadSpec], timeout_s: float) -> LoadJob:
        chunks = [(spec, chunk) for spec in specs for chunk in spec.chunks]
        job = self.placement.new_job([list(g) for g in self.groups], len(chunks), [s.req_id for s in specs])
        job.deadline = time.monotonic() + timeout_s
        job.on_request_loaded = lambda seconds: self.stats.sample(load_s=seconds)
        for g in range(len(self.groups)):
            for i, (spec, chunk) in enumerate(chunks):
                job.expect(g, i, spec.req_id, chunk.chunk_hash, chunk.block_ids)
        for g in range(len(self.groups)):
            for i, (_, chunk) in enumerate(chunks):
                self._pool.submit(self._load_object, job, g, i, chunk)
        return job

    def _load_object(self, job: LoadJob, group: int, index: int, chunk: ChunkLoad) -> None:
        ok = False
        try:
            if not job.cancelled:
                self._fetch_decode_scatter(job, group, chunk)
                ok = True
        except Exception as exc:  # noqa: BLE001 - any failure means "recompute these blocks"
            self.stats.add(load_failures=1, **{f"load_failures_{failure_kind(exc)}": 1})
            logger.warning("kvcodec: load of chunk %s group %d failed, recomputing: %s", chunk.chunk_hash[:12], group, exc)
        finally:
            job.object_done(group, index, ok)

    def _fetch_decode_scatter(self, job: LoadJob, group: int, chunk: ChunkLoad) -> None:
        key = self.addresses.key(chunk.chunk_hash, group)
        t0 = time.perf_counter()
        blob = self.store.get(key)
        if blob is None:
            raise LoadError(f"object {key} is missing", "missing")
        t1 = time.perf_counter()
        if self.observe_transfer is not None:
            self.observe_transfer(len(blob), t1 - t0)
        header = read_header(blob, key=key)  # sizes, checksum and key binding: a swapped object is rejected
        layers = self.groups[group]
        self._check(header, len(layers))
        decoded = self.placement.decode(blob, header, chunk.slots)
        t2 = time.perf_counter()
        if not job.begin_write():
            raise LoadError("load cancelled (timeout)", "timeout")
        try:
            self.placement.scatter(layers, decoded, chunk.first_token)
        finally:
            job.end_write()
        t3 = time.perf_counter()
        self.stats.add(
            loaded_objects=1, loaded_bytes=len(blob), loaded_raw_bytes=header.raw_nbytes,
            fetch_s=t1 - t0, decode_s=t2 - t1, scatter_s=t3 - t2, **{f"codec_{header.codec_id}_loads": 1},
            **({"loaded_tokens": len(chunk.slots)} if group == 0 else {}),
            **({"gpu_decoded_objects": 1} if decoded.on_device else {}),
        )
        self.stats.sample(fetch_s=t1 - t0, decode_s=t2 - t1, scatter_s=t3 - t2)

    def _check(self, header: ChunkHeader, num_layers: int) -> None:
        """The object must hold exactly one layer group of one chunk of this engine's KV, before anything is decoded."""
        a = self.layouts[self.groups[0][0]]
        expected = (num_layers, 2, self.addresses.namespace.chunk_size, a.num_kv_heads, a.head_size)
        if header.shape != expected or header.dtype.torch_dtype != a.dtype:
            raise LoadError(f"stored object holds {header.shape} {header.dtype.name.lower()}, expected {expected} {a.dtype}",
                            "mismatch")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.placement.shutdown()
