"""``KVCodecTier``: vLLM's OffloadingConnector's CPU tier, cascading to this project's stores, compressed.

vLLM's tiered offloading keeps a CPU (primary) tier and moves its rows to and
from secondary tiers through :class:`SecondaryTierManager`, in the scheduler
process, where every call must return at once. It is built inside
:class:`~vllm_kvcodec.offload_tier.connector.KVCodecOffloadingConnector`, which
tells it the engine's config (its rows are keyed in the connector's namespace,
namespace.py) and each request's tokens (each row records their digests,
proofs.py). This tier:

- ``submit_store``: encodes the job's rows with this project's codecs (each
  bound to its key, recording its tokens' digests, checksummed) and puts them
  in one batched store call, on a background thread; rows already known to be
  stored are skipped, rows whose tokens it cannot tell are not stored;
- ``submit_load``: gets the job's objects in one batched call, validates each
  against this tier's row (dtype, shape, key, checksum) and the request's
  tokens before writing it into its primary-tier row, on a background thread;
- ``lookup``: asks the store in batches on vLLM's own
  :class:`AsyncLookupManager` thread (one ``exists_many`` per step), answering
  RETRY until the verdict is in, HIT at once for rows this tier stored;
- ``get_finished_jobs``: hands back what finished. A load that failed for
  some keys reports ``success=False`` with the keys that did load (a subset),
  and marks the failed ones a miss, as vLLM's fs tier does, so the scheduler
  does not ask for them again; a failed store is ``success=False``.

Eviction is the store's (a file store's ``max_bytes``, Redis ``maxmemory``, a
``cache+`` near tier's LRU): an evicted row is a lookup miss, or a load
failure reported as above. The store is opened behind the connector's outage
guard, so a store that is down fails jobs at once instead of stalling them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, ScheduleEndContext, SecondaryTierManager, TransferJob

from storage import Store, open_store
from storage.outage import OutageGuard
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.format import TokenDigests
from vllm_kvcodec.offload_tier import engine_context
from vllm_kvcodec.offload_tier.namespace import store_key, tier_namespace
from vllm_kvcodec.offload_tier.proofs import RowProofs
from vllm_kvcodec.offload_tier.rows import RowCodec
from vllm_kvcodec.keys.token_digests import TokenMismatchError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("vllm_kvcodec")

#: One row of a job: its offload key, its chunk in the CPU tier, its tokens' digests (None: cannot be told).
Row = tuple[OffloadKey, int, TokenDigests | None]


class _StoreLookup(AsyncLookupManager):
    """vLLM's async lookup machinery, answering from one batched ``exists_many`` per request per step."""

    def __init__(self, tier: "KVCodecTier") -> None:
        self._tier = tier  # set before the base class starts its thread
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.store.exists_many([self._tier.key_of(k) for k in keys])


class KVCodecTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str, store: str,
                 codec: str | None = None, channels: int = 64, io_threads: int = 4, salt: str = "",
                 store_retry_s: float = 5.0, locality: str | None = None,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        """``store``: a store URL (storage.open_store); ``codec``: a codec id (None: the default for the KV dtype);
        ``channels``: the codecs' innermost dimension (a divisor of the head size); ``salt``: tenants apart."""
        self.engine = engine_context.current()  # before anything is allocated or opened
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self._rows = primary_kv_view.cast("B") if primary_kv_view.ndim > 1 or primary_kv_view.format != "B" \
            else primary_kv_view
        self.namespace = tier_namespace(self.engine.vllm_config, offloading_spec.config, self.block_size_bytes, salt)
        self.proofs = RowProofs(self.namespace, offloading_spec.config)
        self.row_codec = RowCodec(DType.parse(offloading_spec.config.model.dtype), self.block_size_bytes, codec, channels)
        self.store: Store = OutageGuard(store, open_store, retry_s=store_retry_s)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvcodec-offload")
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey], bool]] = queue.SimpleQueue()
        self._in_flight: set[Future] = set()
        self._in_flight_lock = threading.Lock()
        self._stored: set[OffloadKey] = set()  # rows this tier stored (scheduler thread only)
        self._counters_lock = threading.Lock()
        self.counters: dict[str, int] = {"stored_rows": 0, "stored_bytes": 0, "loaded_rows": 0, "loaded_bytes": 0,
                                         "store_failures": 0, "load_failures": 0, "unproved_rows": 0,
                                         "token_mismatches": 0}
        self._lookup = _StoreLookup(self)
        logger.info("kvcodec offload tier: store %s, codec %s, rows of %d bytes, namespace %s", self.store.url,
                    codec or "default", self.block_size_bytes, self.namespace.digest[:12])

    def key_of(self, key: OffloadKey) -> str:
        return store_key(self.namespace, key)

    def _row(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._rows[int(chunk_id) * size : (int(chunk_id) + 1) * size]

    # -- the scheduler's calls (each returns at once) ---------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.proofs.admit(req_context.req_id, self.engine.arriving(req_context.req_id))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.proofs.knows(req_context.req_id):
            return LookupResult.MISS  # nothing it could load would prove its tokens
        if key in self._stored:
            return LookupResult.HIT
        found = self._lookup.lookup(key, req_context)
        return LookupResult.RETRY if found is None else LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store_rows, job_metadata, [k not in self._stored for k in job_metadata.keys], False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load_rows, job_metadata, [True] * len(job_metadata.keys), True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                result, keys, is_load = self._finished.get_nowait()
            except queue.Empty:
                return results
            if is_load and not result.success:
                ok = set(result.successful_keys or ())
                failed = [k for k in keys if k not in ok]
                self._stored.difference_update(failed)
                self._lookup.mark_miss(failed)
            elif not is_load and result.success:
                self._stored.update(keys)
            results.append(result)

    def has_pending_work(self) -> bool:
        with self._in_flight_lock:
            return bool(self._in_flight) or not self._finished.empty()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)
        self.proofs.forget(req_context.req_id)  # vLLM calls this once no job of the request can come

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def drain_jobs(self) -> None:
        """Wait for every submitted job (none is aborted mid-copy); their results stay queued."""
        while True:
            with self._in_flight_lock:
                pending = list(self._in_flight)
            if not pending:
                return
            for future in pending:
                future.exception()  # waits; the job itself never raises (it reports)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        self.store.close()
        if self._rows is not self._primary_kv_view:
            self._rows.release()  # a view of vLLM's shared memory: while it lives, vLLM cannot unmap it

    # -- the background threads ----------------------------------------------------------

    def _submit(self, work: Any, job: TransferJob, wanted: list[bool], is_load: bool) -> None:
        """Hand the job's wanted rows, with their tokens' digests (made here, on the scheduler thread that owns
        the requests), to a background thread."""
        rows = [(k, int(c), self.proofs.of(k, job.req_context))
                for k, c, w in zip(job.keys, job.chunk_ids, wanted) if w]
        if unproved := sum(proof is None for _, _, proof in rows):
            self._add(unproved_rows=unproved)
        future = self._pool.submit(self._run, work, job.job_id, rows, is_load)
        with self._in_flight_lock:
            self._in_flight.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: Future) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(future)

    def _run(self, work: Any, job_id: int, rows: list[Row], is_load: bool) -> None:
        """One job, start to end: its result is queued whatever happens (a job that raised is a failure)."""
        t0 = time.perf_counter()
        try:
            ok = work([row for row in rows if row[2] is not None])  # an unproved row fails, unread and unwritten
        except Exception as exc:  # noqa: BLE001 - any failure is the job's result, never the scheduler's
            logger.warning("kvcodec offload tier: %s job %d failed: %s", "load" if is_load else "store", job_id, exc)
            ok = []
        keys = [k for k, _, _ in rows]
        success = len(ok) == len(rows)
        self._count(is_load, len(ok), len(rows) - len(ok))
        partial = tuple(ok) if is_load and ok and not success else None
        result = JobResult(job_id=job_id, success=success, successful_keys=partial,
                           transfer_time=time.perf_counter() - t0, transfer_bytes=len(ok) * self.block_size_bytes)
        self._finished.put((result, keys, is_load))

    def _store_rows(self, rows: list[Row]) -> list[OffloadKey]:
        items = [(self.key_of(k), self.row_codec.encode(self._row(c), self.key_of(k), proof)) for k, c, proof in rows]
        if items:
            self.store.put_many(items)
            self._add(stored_bytes=sum(len(v) for _, v in items))
        return [k for k, _, _ in rows]

    def _load_rows(self, rows: list[Row]) -> list[OffloadKey]:
        blobs = self.store.get_many([self.key_of(k) for k, _, _ in rows])
        ok = []
        for (key, chunk, proof), blob in zip(rows, blobs):
            if blob is None:
                continue  # evicted or never stored: this row fails, the others may still load
            try:
                self.row_codec.decode_into(blob, self.key_of(key), self._row(chunk), proof)
            except TokenMismatchError as exc:  # intact and bound to its key, computed for other tokens
                logger.warning("kvcodec offload tier: object %s not loaded: %s", self.key_of(key), exc)
                self._add(token_mismatches=1)
                continue
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign object fails its row only
                logger.warning("kvcodec offload tier: object %s not loaded: %s", self.key_of(key), exc)
                continue
            self._add(loaded_bytes=len(blob))
            ok.append(key)
        return ok

    def _count(self, is_load: bool, ok: int, failed: int) -> None:
        if is_load:
            self._add(loaded_rows=ok, load_failures=failed)
        else:
            self._add(stored_rows=ok, store_failures=failed)

    def _add(self, **counts: int) -> None:
        with self._counters_lock:
            for name, n in counts.items():
                self.counters[name] += n


__all__ = ["KVCodecTier"]
