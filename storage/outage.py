"""A store that may be down: opened when it first answers, skipped for a while after it fails.

Why: an engine must not refuse to start, nor slow to a crawl, because its
cache is away. Two things would otherwise go wrong during an outage:

- opening may fail (a Redis Cluster learns its slot map at open time; a file
  store's directory may be on a mount that is not there yet), which would stop
  the engine at start-up;
- every call pays the store's full timeout (Redis: 2 s to connect, 5 s to
  read), and the scheduler asks the store about every new request, so a
  black-holed store would hold up scheduling for seconds per request.

:class:`OutageGuard` wraps the opening and every call. When the store raises
:class:`~storage.errors.StoreUnavailableError` (or cannot be opened), it is
marked down for ``retry_s`` seconds, during which every call fails at once with
:class:`StoreDownError` (a ``StoreUnavailableError``, so callers already treat
it as a miss or a dropped save). Calls after that try the store again (opening
it if it never opened): a failure re-arms the wait, a success ends the outage.
So an outage costs each calling thread about one timeout per ``retry_s``, not
one per request, and recovery needs no restart. Calls that arrive together
after the wait all try, rather than one trying while the others fail: right
after a store returns, a burst of saves must not be dropped for nothing. The
start and end of each outage are logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from storage.base import Store
from storage.errors import StoreUnavailableError
from storage.options import redact_url
from storage.ranged import RangedValue

logger = logging.getLogger("vllm_kvcodec")
_T = TypeVar("_T")


class StoreDownError(StoreUnavailableError):
    """The store failed recently and is not being asked again until its retry time."""


class OutageGuard(Store):
    def __init__(self, url: str, open_store: Callable[[str], Store], *, retry_s: float = 5.0) -> None:
        if not retry_s >= 0:
            raise ValueError(f"retry_s must be >= 0, got {retry_s}")
        super().__init__(redact_url(url))
        self._target, self._open_store, self.retry_s = url, open_store, retry_s
        self.inner: Store | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0  # monotonic time of the next try while down; 0: up
        self._reason = ""
        self.outages = 0
        try:
            self.inner = open_store(url)
        except StoreUnavailableError as exc:  # a bad URL (StoreURLError) still fails here, as it should
            self._failed(exc)

    @property
    def is_down(self) -> bool:
        """The store failed and its retry time has not come yet."""
        return self._retry_at > time.monotonic()

    @property
    def reason(self) -> str:
        """Why the store is (or was last) down."""
        return self._reason

    def probe(self) -> None:
        """One real round trip (an existence check), ignoring any back-off; raises if it fails."""
        with self._lock:
            self._retry_at = min(self._retry_at, time.monotonic())
        self.exists("kvc/probe")

    # -- every call goes through here --------------------------------------------

    def _call(self, op: Callable[[Store], _T]) -> _T:
        store = self._ready()
        try:
            result = op(store)
        except StoreUnavailableError as exc:
            self._failed(exc)
            raise
        if self._retry_at:
            self._recovered()
        return result

    @property
    def reads_in_memory(self) -> bool:
        inner = self.inner
        return inner is not None and inner.reads_in_memory

    def _ready(self) -> Store:
        with self._lock:
            now = time.monotonic()
            if self._retry_at > now:
                raise StoreDownError(
                    f"{self.url} is down ({self._reason}); next try in {self._retry_at - now:.1f} s"
                )
            if self.inner is not None:
                return self.inner
        try:
            store = self._open_store(self._target)
        except StoreUnavailableError as exc:
            self._failed(exc)
            raise
        with self._lock:
            if self.inner is None:
                self.inner = store
                return store
        store.close()  # another thread opened it first
        return self.inner

    def _failed(self, exc: StoreUnavailableError) -> None:
        with self._lock:
            was_up = not self._retry_at
            self._retry_at = time.monotonic() + self.retry_s
            self._reason = str(exc)
            if was_up:
                self.outages += 1
        if was_up:
            logger.warning(
                "kvcodec: store %s unavailable (%s); lookups count as misses, loads are recomputed and saves "
                "dropped until it answers again (next try in %.1f s)", self.url, exc, self.retry_s,
            )

    def _recovered(self) -> None:
        with self._lock:
            if not self._retry_at:
                return
            self._retry_at = 0.0
        logger.warning("kvcodec: store %s answers again; loads and saves resume", self.url)

    # -- the store protocol ---------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        return self._call(lambda s: s.get(key))

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._call(lambda s: s.get_many(keys))

    @property
    def ranged_reads(self) -> bool:
        inner = self.inner
        return inner is not None and inner.ranged_reads

    def _open_ranged(self, key: str) -> RangedValue | None:
        return self._call(lambda s: s.open_ranged(key))

    def _put(self, key: str, value: memoryview) -> None:
        self._call(lambda s: s.put(key, value))

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        self._call(lambda s: s.put_many(items))

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        return self._call(lambda s: s.replace(key, expected, value))

    def _exists(self, key: str) -> bool:
        return self._call(lambda s: s.exists(key))

    def _exists_many(self, keys: list[str]) -> list[bool]:
        return self._call(lambda s: s.exists_many(keys))

    def _delete(self, key: str) -> None:
        self._call(lambda s: s.delete(key))

    def _keys(self, prefix: str) -> Iterator[str]:
        return self._call(lambda s: s.keys(prefix))

    def _close(self) -> None:
        if self.inner is not None:
            self.inner.close()
