"""The load path: fetch -> decode -> scatter, on threads, layer group by layer group.

Objects are submitted in layer-group order, so the first layers' KV arrives
first and the engine's prefill of the uncached suffix can start on layer 0
while later groups are still on the wire. Decoding (numba/zstd kernels) and
store I/O release the GIL, so threads overlap for real. Memory stays bounded:
each thread holds at most one object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from storage import Store
from vllm_kvcodec.format import decode_chunk, read_header
from vllm_kvcodec.keys import ObjectAddresses
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.paged import PagedKVAdapter

if TYPE_CHECKING:  # both import vLLM; the fetcher itself must not (the GPU check runs without it)
    from vllm_kvcodec.connector.metadata import ChunkLoad, LoadSpec
    from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")


def _one_torch_thread() -> None:
    """Parallelism comes from the fetch threads; intra-op threads would fight the engine for cores."""
    torch.set_num_threads(1)


class LoadError(Exception):
    """A stored object could not be used; its blocks are recomputed."""


class Fetcher:
    def __init__(
        self,
        store: Store,
        addresses: ObjectAddresses,
        caches: list[torch.Tensor],
        adapters: list[PagedKVAdapter],
        threads: int,
        stats: ConnectorStats,
        observe_transfer: Callable[[int, float], None] | None = None,
    ) -> None:
        self.store, self.addresses = store, addresses
        self.observe_transfer = observe_transfer  # feeds the link estimate of codec "auto"
        self.groups, self.caches, self.adapters, self.stats = addresses.groups, caches, adapters, stats
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcodec-fetch", initializer=_one_torch_thread)

    def submit(self, specs: list[LoadSpec], timeout_s: float) -> LoadJob:
        chunks = [(spec, chunk) for spec in specs for chunk in spec.chunks]
        job = self._new_job([list(g) for g in self.groups], len(chunks), [s.req_id for s in specs])
        job.deadline = time.monotonic() + timeout_s
        for g in range(len(self.groups)):
            for i, (spec, chunk) in enumerate(chunks):
                job.expect(g, i, spec.req_id, chunk.chunk_hash, chunk.block_ids)
        for g in range(len(self.groups)):
            for i, (_, chunk) in enumerate(chunks):
                self._pool.submit(self._load_object, job, g, i, chunk)
        return job

    def _new_job(self, group_layers: list[list[int]], objects_per_group: int, req_ids: list[str]) -> LoadJob:
        return LoadJob(group_layers, objects_per_group, req_ids)

    def _load_object(self, job: LoadJob, group: int, index: int, chunk: ChunkLoad) -> None:
        ok = False
        try:
            if not job.cancelled:
                self._fetch_decode_scatter(job, group, chunk)
                ok = True
        except Exception as exc:  # noqa: BLE001 - any failure means "recompute these blocks"
            self.stats.add(load_failures=1)
            logger.warning("kvcodec: load of chunk %s group %d failed, recomputing: %s", chunk.chunk_hash[:12], group, exc)
        finally:
            job.object_done(group, index, ok)

    def _fetch_decode_scatter(self, job: LoadJob, group: int, chunk: ChunkLoad) -> None:
        key = self.addresses.key(chunk.chunk_hash, group)
        t0 = time.perf_counter()
        blob = self.store.get(key)
        if blob is None:
            raise LoadError(f"object {key} is missing")
        t1 = time.perf_counter()
        if self.observe_transfer is not None:
            self.observe_transfer(len(blob), t1 - t0)
        kv = decode_chunk(blob, key=key)  # key-bound: a swapped object is rejected, not loaded
        t2 = time.perf_counter()
        layers = self.groups[group]
        self._check(kv, len(layers))
        part = kv[:, :, chunk.first_token : chunk.first_token + len(chunk.slots)]
        slots = torch.tensor(chunk.slots, dtype=torch.int64)
        if not job.begin_write():
            raise LoadError("load cancelled (timeout)")
        try:
            for i, layer in enumerate(layers):
                self.adapters[layer].scatter(self.caches[layer], slots, part[i], check=False)
        finally:
            job.end_write()
        t3 = time.perf_counter()
        self.stats.add(
            loaded_objects=1, loaded_bytes=len(blob), loaded_raw_bytes=kv.numel() * kv.element_size(),
            fetch_s=t1 - t0, decode_s=t2 - t1, scatter_s=t3 - t2,
            **({"loaded_tokens": len(chunk.slots)} if group == 0 else {}),
        )
        self.stats.add(**{f"codec_{read_header(blob, verify=False).codec_id}_loads": 1})

    def _check(self, kv: torch.Tensor, num_layers: int) -> None:
        a = self.adapters[self.groups[0][0]]
        expected = (num_layers, 2, self.addresses.namespace.chunk_size, a.num_kv_heads, a.head_size)
        if tuple(kv.shape) != expected or kv.dtype != a.dtype:
            raise LoadError(f"stored object holds {tuple(kv.shape)} {kv.dtype}, expected {expected} {a.dtype}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
