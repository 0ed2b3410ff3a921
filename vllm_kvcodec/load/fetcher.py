"""The load path: fetch -> decode -> scatter, on threads, layer group by layer group; one path for every medium.

Objects are submitted in layer-group order, so the first layers' KV arrives
first and the engine's prefill of the uncached suffix can start on layer 0
while later groups are still on the wire. Store I/O and decoding (numba/zstd
kernels) release the GIL, so threads overlap for real.

Objects are fetched in batches, one store round trip each (``get_many``: one
Redis MGET, one Mooncake batch read), of at most ``BATCH_BYTES`` of raw KV: a
distant store costs a few round trips per load, not one per object, and memory
stays bounded (each fetch thread holds one batch until it is decoded). From a
store whose values lie in local files, raw page objects are instead read
straight into their pages, one object at a time (:mod:`.direct_read`).

Fetching and decoding run on two pools: ``threads`` fetch (I/O: several round
trips in flight, GIL released), ``decode_threads`` decode and scatter (CPU).
On a CPU engine the prefill's own threads take the cores, and every decode
thread beyond the cores they leave idle only adds contention: on 2 cores a
4096-token raw load cost 0.13 CPU-s with 4 threads decoding, 0.07 with one.
Per object, whatever the medium:
a missing one fails its blocks; its header is validated once (sizes, checksum,
the key it is bound to, the shape this engine expects), then the
:class:`Placement` decodes and scatters it. What differs between host memory
and a CUDA device is only the placement (:mod:`.placement`:
:class:`~.placement.HostPlacement`, and
:class:`~vllm_kvcodec.load.cuda_placement.CudaPlacement`, which stages, copies
and decodes on a side stream), the way vLLM's offloading code keeps one worker
contract with a transfer handler per medium.

Each layer belongs to one vLLM KV cache group (``cache_groups[layer]``); an
object's layers are scattered with their own group's span of the chunk (see
:mod:`vllm_kvcodec.plans.spans`), so a sliding-window layer gets only the blocks
vLLM allocated for its window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from storage import Store, StoreError
from vllm_kvcodec.codecs.precision import LOSSLESS, stored_precision
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import ChunkHeader, decode_payload, decode_payload_into, payload_of, read_header
from vllm_kvcodec.keys.chain import ObjectAddresses
from vllm_kvcodec.load.direct_read import (PageGeometry, PageRun, copy_into, is_raw, read_head, read_pages_into,
                                           tensor_bytes)
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.load.placement import HostPlacement, Placement
from vllm_kvcodec.runtime.malloc import warm_thread_heap
from vllm_kvcodec.paged import PagedLayout
from vllm_kvcodec.paged.objects import PageObjects, object_layout_for
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.runtime.threads import one_torch_thread, started_pool
from vllm_kvcodec.keys.token_digests import TokenMismatchError, check_tokens

if TYPE_CHECKING:
    from vllm_kvcodec.load.prefetch import Prefetcher
    from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")
_R = TypeVar("_R")
#: Raw KV bytes of the objects one store round trip fetches (and one fetch thread holds at once).
BATCH_BYTES = 8 << 20


class LoadError(Exception):
    """A stored object could not be used; its blocks are recomputed. ``kind`` names why (a metric label)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def failure_kind(exc: BaseException) -> str:
    """Why an object did not load, as ``vllm:kvcodec_load_failures_total``'s ``kind``: missing, corrupt
    (header, checksum, key binding or payload), tokens (an intact object that records other tokens than the
    prompt's), mismatch (another shape or dtype), store (the store failed), timeout (the load was cancelled past
    its deadline) or other."""
    if isinstance(exc, LoadError):
        return exc.kind
    if isinstance(exc, TokenMismatchError):
        return "tokens"
    if isinstance(exc, ChunkFormatError):
        return "corrupt"
    if isinstance(exc, StoreError):
        return "store"
    return "other"


class Read(NamedTuple):
    """One object's read in place: its bytes, the seconds reading took and when it ended."""

    nbytes: int
    seconds: float
    end: float


class Fetcher:
    def __init__(
        self,
        store: Store,
        addresses: ObjectAddresses,
        caches: list[torch.Tensor],
        layouts: list[PagedLayout],
        threads: int,
        stats: ConnectorStats,
        observe_read: Callable[..., None] | None = None,
        placement: Placement | None = None,
        cache_groups: list[int] | None = None,
        decode_threads: int | None = None,
        variants: dict[str, ObjectAddresses] | None = None,
        observe_object: Callable[[str, int, int, float], None] | None = None,
    ) -> None:
        """``decode_threads``: threads that decode and scatter (None: the fetch threads do it themselves).
        ``variants``: where each precision's objects are (lossy precisions: see connector/precisions.py), which a
        chunk's plan names (``ChunkLoad.precisions``); ``observe_object`` is told (precision, stored bytes, raw
        bytes, decode seconds) of each object loaded (save/precision_choice.py)."""
        self.store, self.addresses = store, addresses
        self.observe_read = observe_read  # (nbytes, seconds, end=): feeds the link estimate of codec "auto"
        self.observe_object = observe_object
        self.groups, self.caches, self.layouts, self.stats = addresses.groups, caches, layouts, stats
        self.placement = placement if placement is not None else HostPlacement(caches, layouts, cache_groups)
        self.objects = self.placement.objects = object_layout_for(addresses.namespace.layout_id)
        self.variants = {LOSSLESS: addresses, **(variants or {})}
        self._objects = {p: object_layout_for(a.namespace.layout_id) for p, a in self.variants.items()}
        self._pool = started_pool(threads, "kvcodec-fetch", _warm_thread)
        self._decode_pool: ThreadPoolExecutor | None = None
        self.pages = PageGeometry(caches, layouts, self.placement.cache_groups)  # reads in place, copies into pages
        self._batches_left = 0  # batches queued or running, over every job (settle)
        self._settled = threading.Condition()
        #: Told of each object decoded from fetched bytes (key, bytes, header), after it landed: the save path's
        #: upgrade of fallback-coded objects (:mod:`vllm_kvcodec.save.upgrade`). Must not raise or block.
        self.after_load: Callable[[str, bytes, ChunkHeader], object] | None = None
        self.prefetched: Prefetcher | None = None  # set by the worker half: objects fetched while their requests waited
        self.fetch_threads, self.cpu_threads = threads, threads  # who fetches, who decodes and scatters
        if decode_threads is not None and decode_threads < threads:
            self.cpu_threads = decode_threads
            self._decode_pool = started_pool(decode_threads, "kvcodec-decode", _warm_thread)

    def submit(self, specs: list[LoadSpec], timeout_s: float, refused: Collection[str] = ()) -> LoadJob:
        """Start loading ``specs``; the objects of ``refused`` requests fail unread (their blocks are recomputed)."""
        chunks = [(spec, chunk) for spec in specs for chunk in spec.chunks]
        job = self.placement.new_job([list(g) for g in self.groups], len(chunks), [s.req_id for s in specs])
        job.deadline = time.monotonic() + timeout_s
        job.on_request_loaded = lambda seconds: self.stats.sample(load_s=seconds)
        for g in range(len(self.groups)):
            for i, (spec, chunk) in enumerate(chunks):
                job.expect(g, i, spec.req_id, chunk.chunk_hash, chunk.block_ids)
        read = [(i, chunk) for i, (spec, chunk) in enumerate(chunks) if spec.req_id not in refused]
        self.placement.order_after_reads([chunk for _, chunk in read])
        for g in range(len(self.groups)):  # layer-group order: the first layers' KV arrives first
            for i, (spec, _) in enumerate(chunks):
                if spec.req_id in refused:
                    job.object_done(g, i, ok=False)
            for batch in self._batches(g, read):
                with self._settled:
                    self._batches_left += 1
                try:
                    self._pool.submit(self._counted_batch, job, g, batch)
                except RuntimeError:  # the pool is shut down: the batch never runs, so it is not in the air
                    self._batch_settled()
                    raise
        return job

    def settle(self, timeout: float | None) -> bool:
        """Wait until no batch is queued or reading (False: ``timeout`` came first).

        A load abandoned at its deadline is recomputed at once, but its batches
        still finish their reads here in the background; counters read before
        that lack them (tests, benchmarks: ``KVCodecConnector.flush``).
        """
        with self._settled:
            return self._settled.wait_for(lambda: self._batches_left == 0, timeout)

    def _counted_batch(self, job: LoadJob, group: int, batch: list[tuple[int, ChunkLoad]]) -> None:
        try:
            self._load_batch(job, group, batch)
        except Exception:  # a bug, not a failed read: its objects settle at the job's deadline (recomputed)
            logger.exception("kvcodec: a load batch of group %d raised", group)
        finally:
            self._batch_settled()

    def _batch_settled(self) -> None:
        with self._settled:
            self._batches_left -= 1
            if not self._batches_left:
                self._settled.notify_all()

    def _batches(self, group: int, objects: list[tuple[int, ChunkLoad]]) -> list[list[tuple[int, ChunkLoad]]]:
        """A group's objects in batches of at most BATCH_BYTES of raw KV: one store round trip per batch.

        One get per object would pay the store's round trip once per object per
        thread (96 round trips for a 4k prefix in 6 groups); a whole group in one
        get would hold a long prefix's group in memory at once.
        """
        a = self.layouts[self.groups[group][0]]
        raw = len(self.groups[group]) * self.addresses.namespace.chunk_size * a.token_nbytes()  # about
        per = max(1, BATCH_BYTES // max(1, raw))
        return [objects[i : i + per] for i in range(0, len(objects), per)]

    def _key(self, chunk: ChunkLoad, group: int, precision: str | None = None) -> str:
        """The key of a chunk's object of ``group``, in its first precision's namespace (or ``precision``'s)."""
        return self.variants[precision or chunk.precisions[0]].key(chunk.chunk_hash, group)

    def _load_batch(self, job: LoadJob, group: int, batch: list[tuple[int, ChunkLoad]]) -> None:
        in_place = [(index, chunk) for index, chunk in batch if self._reads_in_place(chunk.precisions[0])]
        if in_place:  # one "fetch" per batch all the same: the time its objects took to read
            reads = [r for r in self._run([(self._settle_in_place, (job, group, index, chunk))
                                           for index, chunk in in_place]) if r is not None]
            if reads:
                self._fetched(job, sum(r.nbytes for r in reads), sum(r.seconds for r in reads), max(r.end for r in reads))
            done = {index for index, _ in in_place}
            batch = [(index, chunk) for index, chunk in batch if index not in done]
            if not batch:
                return
        keys = [self._key(chunk, group) for _, chunk in batch]
        blobs: list[bytes | None] = [None] * len(batch)
        error: Exception | None = None
        t0 = time.perf_counter()
        fetched = False
        # Taken even by a cancelled job: what a load claimed leaves the prefetch budget either way.
        ahead = (self.prefetched.take(keys, job.deadline - time.monotonic()) if self.prefetched is not None
                 else [None] * len(batch))
        if not job.cancelled:
            try:
                got = iter(self.store.get_many([k for k, b in zip(keys, ahead) if b is None]) if None in ahead else [])
                blobs = [b if b is not None else next(got) for b in ahead]
                fetched = True
            except Exception as exc:  # noqa: BLE001 - the whole batch is recomputed
                error = exc
        t1 = time.perf_counter()
        nbytes = sum(len(b) for b, a in zip(blobs, ahead) if b is not None and a is None)  # prefetched: not the link's
        self._fetched(job, nbytes if error is None and None in ahead else None, t1 - t0, t1)
        # The batch stays held (memory bound) until the decode threads are done with it.
        self._run([(self._settle_object, (job, group, index, chunk, key, blob, error, fetched))
                   for (index, chunk), key, blob in zip(batch, keys, blobs)])

    def _run(self, calls: list[tuple[Callable[..., _R], tuple[object, ...]]]) -> list[_R]:
        """Each call on the decode threads (waiting for all), or on this fetch thread where there are none."""
        if self._decode_pool is None:
            return [call(*args) for call, args in calls]
        return [future.result() for future in [self._decode_pool.submit(call, *args) for call, args in calls]]

    def _fetched(self, job: LoadJob, nbytes: int | None, fetch_s: float, end: float) -> None:
        """Count one store round trip of ``fetch_s`` seconds ending at ``end`` (``nbytes`` None: it failed)."""
        job.account(fetch_s=fetch_s)
        if nbytes is not None and self.observe_read is not None:
            self.observe_read(nbytes, fetch_s, end=end)
        self.stats.add(fetch_s=fetch_s, fetch_batches=1)
        self.stats.sample(fetch_s=fetch_s)

    def _settle_object(self, job: LoadJob, group: int, index: int, chunk: ChunkLoad, key: str, blob: bytes | None,
                       error: Exception | None, fetched: bool) -> None:
        """Decode and scatter one fetched object, or count why it cannot be; either way it is done."""
        ok = False
        try:
            if error is not None:
                raise LoadError(f"store get failed: {error}", "store")
            if fetched:
                if job.cancelled:  # read, then dropped: the load timed out meanwhile (counted as such)
                    raise LoadError("load cancelled (timeout)", "timeout")
                self._decode_scatter(job, group, chunk, key, blob)
                ok = True
        except Exception as exc:  # noqa: BLE001 - any failure means "recompute these blocks"
            ok = self._fall_back(job, group, chunk, exc)
        finally:
            job.object_done(group, index, ok)

    def _fall_back(self, job: LoadJob, group: int, chunk: ChunkLoad, exc: BaseException) -> bool:
        """A chunk's object that failed in its first precision (precision auto: the lossy variant, missing or bad)
        read in the next one (the lossless object its lookup found), alone: no recompute for a missing variant.
        True if one landed; else the failure is counted (the blocks are recomputed)."""
        for precision in chunk.precisions[1:]:
            if job.cancelled:
                break
            key = self._key(chunk, group, precision)
            logger.debug("kvcodec: %s object of chunk %s group %d failed (%s); reading %s", chunk.precisions[0],
                         chunk.chunk_hash[:12], group, exc, precision)
            try:
                self._decode_scatter(job, group, chunk, key, self.store.get(key), precision)
            except Exception as later:  # noqa: BLE001 - the next precision, or recompute
                exc = later
                continue
            self.stats.add(precision_fallbacks=1)
            return True
        self._failed(exc, chunk, group)
        return False

    def _failed(self, exc: BaseException, chunk: ChunkLoad, group: int) -> None:
        self.stats.add(load_failures=1, **{f"load_failures_{failure_kind(exc)}": 1})
        logger.warning("kvcodec: load of chunk %s group %d failed, recomputing: %s", chunk.chunk_hash[:12], group, exc)

    # ---- objects read in place (a local file store; see direct_read) ----------------------------------------

    def _host_pages(self, precision: str = LOSSLESS) -> bool:
        """Page objects into host caches: what reads in place and ``copy_into`` write (by page extents)."""
        return isinstance(self._objects[precision], PageObjects) and type(self.placement) is HostPlacement

    def _page_runs(self, layers: list[int], spans: list[Span], header: ChunkHeader,
                   precision: str = LOSSLESS) -> list[PageRun] | None:
        """Where a page object into host caches goes, run by run (None: elsewhere, or not landing whole)."""
        return self.pages.runs(layers, spans, header) if self._host_pages(precision) else None

    def _reads_in_place(self, precision: str = LOSSLESS) -> bool:
        return self._host_pages(precision) and self.store.ranged_reads

    def _settle_in_place(self, job: LoadJob, group: int, index: int, chunk: ChunkLoad) -> Read | None:
        """One object opened in the store: its pages read straight into the cache where they can be, else decoded."""
        ok, read = False, None
        try:
            if not job.cancelled:  # cancelled before it was read: nothing to count
                read = self._read_in_place(job, group, chunk, self._key(chunk, group))
                ok = True
        except Exception as exc:  # noqa: BLE001 - any failure means "recompute these blocks"
            ok = self._fall_back(job, group, chunk, exc)
        finally:
            job.object_done(group, index, ok)
        return read

    def _read_in_place(self, job: LoadJob, group: int, chunk: ChunkLoad, key: str) -> Read:
        """(bytes, seconds, when done) of the reads, for the batch's one fetch count."""
        t0 = time.perf_counter()
        try:
            value = self.store.open_ranged(key)
        except StoreError as exc:
            raise LoadError(f"store read failed: {exc}", "store") from exc
        if value is None:
            raise LoadError(f"object {key} is missing", "missing")
        with value:
            head, header = read_head(value, key)
            layers = self.groups[group]
            self._check(header, chunk, len(layers), key, chunk.precisions[0])
            runs = self._page_runs(layers, chunk.spans, header, chunk.precisions[0]) if is_raw(header) else None
            if runs is None:  # compressed, or not landing whole: read it all, then decode and scatter
                blob = value.read(0, value.size)
                t1 = time.perf_counter()
                self._decode_scatter(job, group, chunk, key, blob)
                return Read(len(blob), t1 - t0, t1)
            buffers = self.pages.buffers(runs)
            check_s = read_pages_into(value, head, header, buffers, lambda read: self._write(job, read))
        t1 = time.perf_counter()
        job.account(cpu_s=check_s)
        self._loaded(group, chunk, header, value.size, decode_s=check_s, scatter_s=0.0, on_device=False,
                     precision=chunk.precisions[0])
        self.stats.add(objects_read_in_place=1)
        return Read(value.size, t1 - t0 - check_s, t1 - check_s)

    @staticmethod
    def _write(job: LoadJob, write: Callable[[], _R]) -> _R:
        """A write into paged memory, only while the load is not cancelled (a cancelled load's blocks are vLLM's)."""
        if not job.begin_write():
            raise LoadError("load cancelled (timeout)", "timeout")
        try:
            return write()
        finally:
            job.end_write()

    # ---- decode, then scatter ---------------------------------------------------------------------------------

    def _decode_scatter(self, job: LoadJob, group: int, chunk: ChunkLoad, key: str, blob: bytes | None,
                        precision: str | None = None) -> None:
        """Check, decode and scatter one fetched object of the chunk's first precision (or ``precision``)."""
        if blob is None:
            raise LoadError(f"object {key} is missing", "missing")
        precision = precision or chunk.precisions[0]
        t1 = time.perf_counter()
        header = read_header(blob, key=key)  # sizes, checksum and key binding: a swapped object is rejected
        layers = self.groups[group]
        self._check(header, chunk, len(layers), key, precision)
        if (runs := self._page_runs(layers, chunk.spans, header, precision)) is not None:
            t2 = self._into_pages(job, blob, header, runs)
            on_device = False
        else:
            decoded = self.placement.decode(blob, header, chunk.spans)
            decoded.objects = self._objects[precision]
            t2 = time.perf_counter()
            self._write(job, lambda: self.placement.scatter(layers, decoded))
            on_device = decoded.on_device
        t3 = time.perf_counter()
        job.account(cpu_s=t3 - t1)
        self._loaded(group, chunk, header, len(blob), decode_s=t2 - t1, scatter_s=t3 - t2, on_device=on_device,
                     precision=precision)
        if self.after_load is not None:
            self.after_load(key, blob, header)

    def _into_pages(self, job: LoadJob, blob: bytes, header: ChunkHeader, runs: list[PageRun]) -> float:
        """A page object landing whole, whose (decoded) payload is its pages in order: decoded straight into them
        where the codec can (decode and scatter are then one pass, counted as decode), else decoded and copied
        there. Returns when its decode ended."""
        raw = is_raw(header)
        if not raw and self._write(job, lambda: decode_payload_into(blob, header, self.pages.extents(runs))):
            self.stats.add(objects_decoded_into_pages=1)
            return time.perf_counter()
        pages = payload_of(blob, header) if raw else tensor_bytes(decode_payload(blob, header))
        decoded = time.perf_counter()
        self._write(job, lambda: copy_into(pages, self.pages.buffers(runs)))
        return decoded

    def _loaded(self, group: int, chunk: ChunkLoad, header: ChunkHeader, nbytes: int, *, decode_s: float,
                scatter_s: float, on_device: bool, precision: str) -> None:
        """Count one object in place; ``precision``: the namespace it was read from (what it holds: its header)."""
        self.stats.add(
            loaded_objects=1, loaded_bytes=nbytes, loaded_raw_bytes=header.raw_nbytes,
            decode_s=decode_s, scatter_s=scatter_s, **{f"codec_{header.codec_id}_loads": 1},
            **{f"precision_reads_{stored_precision(header.codec_config)}": 1},
            **({"loaded_tokens": chunk.tokens} if group == 0 else {}),
            **({"gpu_decoded_objects": 1} if on_device else {}),
        )
        self.stats.sample(decode_s=decode_s, scatter_s=scatter_s)
        if self.observe_object is not None:
            self.observe_object(precision, nbytes, header.raw_nbytes, decode_s)

    def _check(self, header: ChunkHeader, chunk: ChunkLoad, num_layers: int, key: str, precision: str) -> None:
        """Before anything is decoded: the object must hold exactly one layer group of this engine's KV for the
        chunk's tokens, as ``precision``'s namespace lays it out, and record this prompt's tokens for every token the load
        writes (``chunk.expect``). A lossless read takes no lossy object, whatever key it is bound to (the
        namespaces keep them apart; this keeps a miswritten store from doing otherwise)."""
        if precision == LOSSLESS and stored_precision(header.codec_config) != LOSSLESS:
            raise LoadError(f"object {key} is lossy ({header.codec_config.get('id')}), read as lossless", "mismatch")
        first = self.groups[0][0]
        a = self.layouts[first]
        tokens = chunk.object_tokens or self.addresses.namespace.chunk_size
        expected = self._objects[precision].object_shape(num_layers, a, self.caches[first], tokens)
        if header.shape != expected or header.dtype.torch_dtype != a.dtype:
            raise LoadError(f"stored object holds {header.shape} {header.dtype.name.lower()}, expected {expected} {a.dtype}",
                            "mismatch")
        if chunk.expect is not None:
            check_tokens(header.tokens, chunk.expect, key)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._settled:  # batches cancelled before they ran are not in the air either
            self._batches_left = 0
            self._settled.notify_all()
        if self._decode_pool is not None:
            self._decode_pool.shutdown(wait=True)
        self.placement.shutdown()


def _warm_thread() -> None:
    """Pool initializer: one torch thread, and a batch's worth of this thread's heap faulted in before any load."""
    one_torch_thread()
    warm_thread_heap(BATCH_BYTES)
