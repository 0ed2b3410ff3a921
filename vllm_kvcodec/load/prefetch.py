"""Prefetch: the objects of a lookup's hit, fetched while their request waits, held until its load takes them.

Why: once the lookup has answered, a request may still wait, for blocks, or
behind other prefills; across a network its load would then start only when
it is scheduled, and pay the link's round trips and bandwidth there, in its
TTFT. Here, in the worker process (the scheduler half only names the chunks,
through the step's metadata), a few threads fetch those objects into host
memory within a byte budget (``prefetch_bytes``); what does not fit is
fetched at load time as before. The load takes the bytes instead of asking
the store, and decodes them through the same path as any fetched object: the
header, checksum and key binding are checked then, so a prefetched object is
trusted no more than a fetched one.

A request that ends, is preempted, or loads gives its objects up: those not
taken are dropped (counted as wasted bytes), fetches not started are
cancelled. Objects shared by several waiting requests (a common prefix) are
fetched once and held while any of them still waits.

Counters: ``prefetched_bytes`` (fetched ahead), ``prefetch_used_bytes``
(taken by a load), ``prefetch_wasted_bytes`` (dropped untaken),
``prefetch_skipped_objects`` (no room in the budget).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from storage import Store
from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")
#: How long a load waits for a prefetch of its object still in the air before fetching it itself.
TAKE_WAIT_S = 5.0


@dataclasses.dataclass(eq=False)
class _Held:
    """One object fetched (or being fetched) ahead, the bytes it holds in the budget, and who waits for it."""

    future: Future
    reserved: int
    owners: set[str] = dataclasses.field(default_factory=set)
    job: Future | None = None  # the pool's: cancelled if nobody wants the object before its fetch starts


class Prefetcher:
    def __init__(self, store: Store, budget: int, stats: ConnectorStats, *, threads: int = 2) -> None:
        self.store, self.budget, self.stats = store, budget, stats
        self._held: dict[str, _Held] = {}
        self._of_request: dict[str, set[str]] = {}
        # Claimed by submitted loads, oldest first, not yet taken by their fetch threads: a key fetched ahead
        # again (for another waiting request) and claimed by a second load before the first took its copy has two.
        self._claimed: dict[str, list[_Held]] = {}
        self._reserved = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcodec-prefetch")

    def start(self, req_id: str, objects: list[tuple[str, int]]) -> None:
        """Fetch ``objects`` (key, bytes at most) ahead for ``req_id``, as far as the budget has room."""
        with self._lock:
            mine = self._of_request.setdefault(req_id, set())
            for key, size in objects:
                held = self._held.get(key)
                if held is None:
                    if self._reserved + size > self.budget:
                        self.stats.add(prefetch_skipped_objects=1)
                        continue
                    self._reserved += size
                    held = self._held[key] = _Held(Future(), size)
                    held.job = self._pool.submit(self._fetch, key, held)
                held.owners.add(req_id)
                mine.add(key)

    def claim(self, keys: list[str]) -> None:
        """A load was just submitted for ``keys``: what is held of them is its own now, whoever else waited for it
        (the load writes those blocks; the others then hit them locally), until its fetch threads take them."""
        with self._lock:
            for key in keys:
                held = self._held.pop(key, None)
                if held is not None:
                    for owner in held.owners:
                        self._of_request.get(owner, set()).discard(key)
                    self._claimed.setdefault(key, []).append(held)

    def take(self, keys: list[str], wait_s: float = TAKE_WAIT_S) -> list[bytes | None]:
        """Per key, the bytes a load claimed (removed from the budget), or None: fetch it now.

        A prefetch still in the air is waited for up to ``wait_s`` (the load's
        time left, at most TAKE_WAIT_S): a store that holds it longer is the
        load's timeout either way, and fetching again would only queue behind it.
        """
        end = time.monotonic() + min(wait_s, TAKE_WAIT_S)
        with self._lock:
            found = [self._take_claimed(k) for k in keys]
        out: list[bytes | None] = []
        for held in found:
            blob = None
            if held is not None:
                try:
                    blob = held.future.result(max(0.0, end - time.monotonic()))
                except Exception:  # noqa: BLE001 - late or failed: the load fetches it itself
                    blob = None
                self._release(held.reserved)
                if blob is not None:
                    self.stats.add(prefetch_used_bytes=len(blob))
            out.append(blob)
        return out

    def _take_claimed(self, key: str) -> _Held | None:
        """The oldest claimed copy of ``key`` (lock held): each claim's bytes are taken, and released, once."""
        claimed = self._claimed.get(key)
        if not claimed:
            return None
        held = claimed.pop(0)
        if not claimed:
            del self._claimed[key]
        return held

    def give_up(self, req_id: str) -> None:
        """``req_id`` no longer waits for its objects (it loaded, ended or was preempted): drop those nobody else wants."""
        with self._lock:
            dropped = []
            for key in self._of_request.pop(req_id, set()):
                held = self._held.get(key)
                if held is None:
                    continue
                held.owners.discard(req_id)
                if not held.owners:
                    del self._held[key]
                    dropped.append(held)
        for held in dropped:
            if held.job is not None and held.job.cancel():  # never started: nothing fetched, nothing wasted
                self._release(held.reserved)
            elif not held.future.done() or held.future.exception() is not None:
                held.future.add_done_callback(lambda f, h=held: self._wasted(h, f))
            else:
                self._wasted(held, held.future)

    def held_bytes(self) -> int:
        """Bytes reserved in the budget: fetched or being fetched ahead, or claimed by a load not yet at them."""
        with self._lock:
            return self._reserved

    def waiting(self) -> list[str]:
        with self._lock:
            return [r for r, keys in self._of_request.items() if keys]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, key: str, held: _Held) -> None:
        try:
            blob = self.store.get(key)
        except Exception as exc:  # noqa: BLE001 - a prefetch that fails is a fetch at load time
            held.future.set_exception(exc)
            return
        if blob is not None:
            self.stats.add(prefetched_bytes=len(blob))
        held.future.set_result(blob)

    def _wasted(self, held: _Held, future: Future) -> None:
        blob = None if future.exception() is not None else future.result()
        if blob is not None:
            self.stats.add(prefetch_wasted_bytes=len(blob))
        self._release(held.reserved)

    def _release(self, size: int) -> None:
        with self._lock:
            self._reserved -= size
