"""The save path after paged memory: background encode -> put, with bounded memory.

``submit`` only queues a gathered chunk (already copied out of paged memory),
so the engine never waits on encoding or the network. Queued raw bytes are
capped; past the cap new chunks are dropped and counted (a dropped save is a
future cache miss, never an error). While the store is known to be down, new
chunks are dropped (counted, one warning per outage) before any encoding work.
Every chunk's outcome (stored, or not) goes to ``report``, which the worker half
passes on to the scheduler half: a save that did not land is planned again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future

import torch

from storage import Store
from vllm_kvcodec.keys.block_refs import Ref, encode_ref, ref_key
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.format import TokenDigests, encode_chunk
from vllm_kvcodec.codecs.precision import LOSSLESS, stored_precision
from vllm_kvcodec.keys.chain import ObjectAddresses
from vllm_kvcodec.plans.outcomes import SaveOutcome
from vllm_kvcodec.save.held_saves import HeldSaves, Released
from vllm_kvcodec.save.lossy_objects import LossyObjects
from vllm_kvcodec.stats import ConnectorStats
from vllm_kvcodec.runtime.threads import one_torch_thread, started_pool

logger = logging.getLogger("vllm_kvcodec")
DROP_LOG_INTERVAL_S = 10.0


def yield_to_engine(nice: int) -> None:
    """One torch thread (:mod:`vllm_kvcodec.runtime.threads`), CPU priority lowered by ``nice`` (Linux: per thread).

    Encoding is background work with a deadline of "before the chunk is asked
    for"; the engine's threads computing the next step are on every request's
    critical path. At saturation they compete for the same cores, and a niced
    encoder takes only the cycles the engine leaves (saves then queue up to
    ``max_pending_save_bytes`` and are dropped past it, counted).
    """
    one_torch_thread()
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):  # not permitted or not supported: run at the engine's priority
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


@dataclasses.dataclass(frozen=True, eq=False)
class _Job:
    """One gathered chunk to encode and store, with what its header and refs record."""

    chunk_hash: str
    kv: torch.Tensor
    nbytes: int  # raw bytes reserved for it in the budget
    req_id: str
    tokens: int
    refs: tuple[tuple[str, int], ...]
    digests: TokenDigests | None
    precisions: tuple[str, ...] = (LOSSLESS,)  # the namespaces it is stored in (connector/precisions.py)
    first_chunk: bool = False  # its sequence's first chunk: a lossy level keeps its sink tokens exact


@dataclasses.dataclass(frozen=True)
class SaveCounts:
    """Chunk saves that ended since the saver started: stored, or failed (encode or put)."""

    landed: int = 0
    failed: int = 0


class Saver:
    def __init__(
        self,
        store: Store,
        addresses: ObjectAddresses,
        chooser: CodecChooser,
        threads: int,
        max_pending_bytes: int,
        stats: ConnectorStats,
        report: Callable[[SaveOutcome], None] = lambda outcome: None,
        nice: int = 0,
        held: HeldSaves | None = None,
        lossy: LossyObjects | None = None,
        observe_object: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """``held``: where saves wait for every worker's outcome of their loads (:mod:`~.held_saves`), given where
        more than one worker runs each load; None: a save rests on this worker's loads only, known at submit.
        ``lossy``: where and how a lossy precision's objects are stored (None: lossless only); ``observe_object``
        is told (precision, stored bytes, raw bytes) of each chunk stored (save/precision_choice.py)."""
        self.store, self.addresses, self.groups = store, addresses, addresses.groups
        self.lossy, self.observe_object = lossy, observe_object
        self.variants = {LOSSLESS: addresses, **(lossy.addresses if lossy is not None else {})}
        self.chooser, self.stats, self.max_pending = chooser, stats, max_pending_bytes
        self.report = report
        self._dropping_for_outage = False
        self._pool = started_pool(threads, "kvcodec-save", yield_to_engine, (nice,))
        self.threads = threads
        self._lock = threading.Lock()
        self._pending = 0
        self._waiting = 0  # submitted chunks no thread has started on
        self._futures: set[Future] = set()
        self._ended = SaveCounts()
        self._last_drop_log = -DROP_LOG_INTERVAL_S
        self._drops_unlogged = 0
        self.held = held

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the budget for a chunk about to be gathered; False (counted) if they do not fit.

        Reserving before the copy, not at submit, keeps a long prefill step from
        gathering more than the budget: memory follows the cap, not the step.
        """
        with self._lock:
            if self._pending + nbytes > self.max_pending:
                self._drop("before gathering")
                return False
            self._pending += nbytes
            return True

    def room(self) -> int:
        """Bytes the save queue can take now (what a save dropped for lack of room waits for)."""
        with self._lock:
            return self.max_pending - self._pending

    def idle(self) -> bool:
        """Nothing reserved, queued or being encoded: spare CPU for work that may wait (upgrades)."""
        with self._lock:
            return self._pending == 0 and self._waiting == 0 and not self._futures

    def in_flight(self) -> int:
        """Chunk saves queued, being encoded and stored, or held for their loads' outcome (which the engine's next
        step brings: see held_saves.py)."""
        with self._lock:
            return len(self._futures) + (len(self.held) if self.held is not None else 0)

    def counts(self) -> SaveCounts:
        with self._lock:
            return self._ended

    def unreserve(self, nbytes: int) -> None:
        """Give back a reservation whose chunk will not be submitted."""
        with self._lock:
            self._pending -= nbytes

    def submit(self, chunk_hash: str, kv: torch.Tensor, req_id: str = "", reserved: bool = False,
               tokens: int | None = None, refs: Sequence[tuple[str, int]] = (),
               digests: TokenDigests | None = None, hold: Collection[int] = (),
               precisions: Sequence[str] = (LOSSLESS,), first_chunk: bool = False) -> bool:
        """Queue ``kv`` ``[layers, 2, chunk, heads, dim]`` for encoding and storing (its bytes reserved, or not yet);
        every object records ``digests`` of its tokens (:mod:`~vllm_kvcodec.keys.token_digests`); once it landed, rank 0
        writes its block refs ``refs`` (prefix hash and tokens each; see :mod:`~vllm_kvcodec.keys.block_refs`).
        ``hold``: the loads it was computed after whose every-worker outcome is not known yet (see ``held``).
        ``precisions``: the namespaces it is stored in, each one object per layer group (``first_chunk``: its
        sequence's first, whose sink tokens a lossy level keeps exact)."""
        nbytes = kv.numel() * kv.element_size()
        job = _Job(chunk_hash, kv, nbytes, req_id, kv.shape[2] if tokens is None else tokens, tuple(refs), digests,
                   tuple(precisions), first_chunk)
        if self._store_is_down():
            if reserved:
                self.unreserve(nbytes)
            self.report(SaveOutcome(req_id, chunk_hash, landed=False))
            return False
        with self._lock:
            if not reserved and self._pending + nbytes > self.max_pending:
                self._drop("at submit")
                self.report(SaveOutcome(req_id, chunk_hash, landed=False, needs_room=nbytes))
                return False
            if not reserved:
                self._pending += nbytes
            if hold and self.held is not None:
                self.stats.add(saves_held_for_load_outcome=1)
                released = self.held.hold(job, hold)
            else:
                released = Released([job], [], [])
        self._release(released)
        return True

    def settle_loads(self, verdicts: Mapping[int, bool]) -> None:
        """Loads every worker reported (load id -> failed on one of them): store the held saves they clear, drop
        those computed over a failure (reported as not landed: the request recomputes and saves them)."""
        if self.held is None:
            return
        with self._lock:
            released = self.held.settle(verdicts)
        self._release(released)

    def _release(self, released: Released) -> None:
        for job in released.ready:
            self._enqueue(job)
        for jobs, load_failed in ((released.failed, True), (released.expired, False)):
            for job in jobs:
                with self._lock:
                    self._pending -= job.nbytes
                self.report(SaveOutcome(job.req_id, job.chunk_hash, landed=False, load_failed=load_failed))
        if released.failed:
            self.stats.add(saves_dropped_after_load_failure_elsewhere=len(released.failed))
        if released.expired:
            self.stats.add(saves_dropped_load_unsettled=len(released.expired))
            logger.warning("kvcodec: dropped %d chunk save(s) whose loads' outcome never came from every worker",
                           len(released.expired))

    def _enqueue(self, job: _Job) -> None:
        with self._lock:
            self._waiting += 1
            future = self._pool.submit(self._encode_put, job)
            self._futures.add(future)
        future.add_done_callback(self._forget)

    def _drop(self, what: str) -> None:
        """Count a save that did not fit; warn at most every DROP_LOG_INTERVAL_S (a long prefill drops many)."""
        self.stats.add(saves_dropped=1)
        self._drops_unlogged += 1
        now = time.monotonic()
        if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:
            logger.warning("kvcodec: save queue full (%d of %d bytes in use), dropped %d chunk save(s) %s",
                           self._pending, self.max_pending, self._drops_unlogged, what)
            self._last_drop_log, self._drops_unlogged = now, 0

    def _store_is_down(self) -> bool:
        """Drop (and count) saves while the store is down; warn once per outage."""
        down = self.store.is_down
        if down:
            self.stats.add(saves_dropped_store_down=1)
            if not self._dropping_for_outage:
                logger.warning("kvcodec: store is down; dropping chunk saves until it answers again")
        self._dropping_for_outage = down
        return down

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)

    def _behind(self) -> bool:
        """Whether a full round of chunks (one per save thread) waits behind the one this thread starts on.

        Then the saver encodes slower than the engine computes: those chunks
        take the cheaper codec (``save_codec_when_behind``), so the backlog
        clears with fewer CPU seconds taken from the engine, at a few percent
        of ratio, instead of waiting for the budget to drop them.
        """
        with self._lock:
            self._waiting -= 1
            return self._waiting >= self.threads

    def _encode_put(self, job: _Job) -> None:
        chunk_hash, nbytes, tokens = job.chunk_hash, job.nbytes, job.tokens
        landed = False
        try:
            t0 = time.perf_counter()
            behind = self._behind()
            items: list[tuple[str, bytes]] = []
            for precision in job.precisions:
                items += self._encode(job, precision, behind)
            t1 = time.perf_counter()
            self.store.put_many(items)
            t2 = time.perf_counter()
            stored = sum(len(v) for _, v in items)
            self.chooser.observe_write(stored, t2 - t1, end=t2)
            self.stats.add(saved_chunks=1, saved_objects=len(items), saved_tokens=tokens,
                           saved_bytes=stored, saved_raw_bytes=nbytes, encode_s=t1 - t0, put_s=t2 - t1,
                           **({"saves_behind": 1} if behind else {}))
            landed = True
            self._put_refs(self.variants[job.precisions[0]], chunk_hash, tokens, job.refs)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            self.stats.add(save_failures=1)
            logger.warning("kvcodec: saving chunk %s failed: %s", chunk_hash[:12], exc)
        finally:
            with self._lock:
                self._pending -= nbytes
                ended = self._ended
                self._ended = SaveCounts(ended.landed + landed, ended.failed + (not landed))
            self.report(SaveOutcome(job.req_id, chunk_hash, landed))

    def _encode(self, job: _Job, precision: str, behind: bool) -> list[tuple[str, bytes]]:
        """One object per layer group of ``job`` in ``precision``'s namespace, each bound to its key and tokens."""
        keys = [self.variants[precision].key(job.chunk_hash, g) for g in range(len(self.groups))]
        t0 = time.perf_counter()
        if precision == LOSSLESS:
            codec = self.chooser.codec_for(job.kv[: len(self.groups[0])], behind=behind)
            items = [(key, encode_chunk(job.kv[layers.start : layers.stop], codec, key=key, tokens=job.digests))
                     for key, layers in zip(keys, self.groups)]
            codecs = [codec]
        else:
            assert self.lossy is not None, f"a {precision} save on a saver without lossy objects"
            items, codecs = self.lossy.encode(job.kv, keys, job.digests, job.first_chunk, lossless_beside=LOSSLESS
                                              in job.precisions)
        if not items:
            return items  # a variant not stored (the chunk holds NaN or inf: lossless only)
        held = stored_precision(codecs[0].get_config())  # what the objects hold (a NaN chunk: lossless)
        stored = sum(len(v) for _, v in items)
        self.stats.add(**{f"codec_{codecs[0].codec_id}_saves": 1, f"precision_saves_{held}": len(items),
                          f"precision_saved_bytes_{held}": stored,
                          f"precision_encode_s_{held}": time.perf_counter() - t0})
        if self.observe_object is not None:
            self.observe_object(precision, stored, job.nbytes)
        return items

    def _put_refs(self, addresses: ObjectAddresses, chunk_hash: str, tokens: int,
                  refs: Sequence[tuple[str, int]]) -> None:
        """The object's block refs in its namespace, after it landed (a ref never names an object not yet stored),
        by one rank only (they are namespace-wide: ``writes_refs``), each bound to its own key. A ref that fails to
        land is a shorter hit later, not a failed save."""
        if not refs or not addresses.writes_refs:
            return
        ref = Ref(chunk_hash, tokens)
        items = [(ref_key(addresses.namespace, h), encode_ref(h, t, ref)) for h, t in refs]
        try:
            self.store.put_many(items)
        except Exception as exc:  # noqa: BLE001 - refs are an index: losing one costs a shorter hit
            self.stats.add(ref_save_failures=1)
            logger.warning("kvcodec: saving the block refs of chunk %s failed: %s", chunk_hash[:12], exc)
            return
        self.stats.add(saved_refs=len(items), saved_ref_bytes=sum(len(v) for _, v in items))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves (tests, benchmarks, shutdown); True if all finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                futures = list(self._futures)
            if not futures:
                return True
            for f in futures:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    f.result(timeout=remaining)
                except Exception:  # noqa: BLE001 - already counted in _encode_put
                    pass
                if deadline is not None and time.monotonic() >= deadline:
                    return False

    def shutdown(self, timeout: float = 30.0, since: SaveCounts | None = None) -> None:
        """Store what is queued within ``timeout`` seconds (what is left of the connector's ``shutdown_flush_s``),
        then stop, and say what became of the saves queued since ``since``, the counts when the engine last
        stopped computing (vLLM's drain at shutdown stores most of them before: see background_work.py).

        A queued save is a chunk the next engine would otherwise recompute, so
        shutdown waits for it, but not without bound: vLLM kills the engine at
        its own shutdown timeout. What is left at the bound is dropped, and
        said so (how many), rather than lost without a word.
        """
        with self._lock:
            unsettled = self.held.take_all() if self.held is not None else []
        if unsettled:  # their loads' outcome will never come: storing them could store KV computed over a failure
            self._release(Released([], [], unsettled))
        queued, before = self.in_flight(), self.counts()
        t0 = time.monotonic()
        stored_all = self.flush(timeout)
        left = self.in_flight()
        self._pool.shutdown(wait=False, cancel_futures=True)
        after, since = self.counts(), since or before
        earlier, now = before.landed - since.landed, after.landed - before.landed
        failed = f"; {after.failed - since.failed} failed" if after.failed > since.failed else ""
        logger.info("kvcodec: shutdown: stored the %d chunk save(s) still queued when the engine stopped computing "
                    "(%d before shutdown, %d at shutdown in %.2f s)%s", earlier + now, earlier, now,
                    time.monotonic() - t0, failed)
        if not stored_all:
            logger.warning("kvcodec: shutdown: %d of the %d chunk save(s) queued at shutdown not stored within "
                           "%.1f s (what was left of shutdown_flush_s); dropped, they will be recomputed", left,
                           queued, timeout)
