"""A network link in front of any store, for benchmarks: bandwidth plus round-trip time.

Why: fetch pipelines must be judged on the link they will meet in production
(a 10 Gbit/s NIC with 0.2 ms RTT, a 1 Gbit/s cross-zone hop) while running
against a local store on a laptop or CI box.

Model: one link shared by every thread using this wrapper. Bytes are scheduled
on a single virtual clock (a token bucket with no burst allowance): a transfer
of ``n`` bytes occupies the link for ``8 n / (gbps * 1e9)`` seconds, starting
when both the call and the link are free, so concurrent transfers queue behind
one another and together never exceed the set bandwidth, as on a real link.
Each call then pays one RTT of latency, which does overlap between threads:
latency is not capacity. Batched calls (``get_many``, ``put_many``,
``exists_many``) pay one RTT per batch, which is the point of batching. Only
value bytes count; keys, headers and replies to ``exists`` are free. The wrapped
store's own time overlaps the emulated time rather than adding to it, so the
emulation is faithful as long as the inner store is faster than the link.

Use it as a class, ``LinkEmulator(store, gbps=1.0, rtt_ms=0.5)``, or from a URL
by prefixing any store URL with ``link+`` and adding ``gbps`` and ``rtt_ms`` to
its query: ``link+file:///tmp/kv?gbps=1&rtt_ms=0.5``,
``link+redis://host:6379/0?gbps=10&rtt_ms=0.2&prefix=kv/`` (the link options are
taken out, the rest goes to the inner store).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from storage.base import Store
from storage.errors import StoreURLError
from storage.options import parse_float, redact_url, split_query, with_query


class LinkEmulator(Store):
    def __init__(self, store: Store, *, gbps: float, rtt_ms: float = 0.0) -> None:
        if not gbps > 0 or rtt_ms < 0:
            raise ValueError(f"a link needs gbps > 0 and rtt_ms >= 0, got gbps={gbps}, rtt_ms={rtt_ms}")
        super().__init__(_link_url(store.url, gbps, rtt_ms))
        self.inner = store
        self._seconds_per_byte = 8.0 / (gbps * 1e9)
        self._rtt = rtt_ms / 1000.0
        self._lock = threading.Lock()
        self._link_free_at = 0.0

    def _transfer(self, started: float, nbytes: int) -> None:
        """Book ``nbytes`` on the shared link, then sleep until they and one RTT have passed."""
        with self._lock:
            start = max(started, self._link_free_at)
            self._link_free_at = start + nbytes * self._seconds_per_byte
            deadline = self._link_free_at + self._rtt
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def _get(self, key: str) -> bytes | None:
        started = time.perf_counter()
        value = self.inner.get(key)
        self._transfer(started, len(value) if value is not None else 0)
        return value

    def _put(self, key: str, value: memoryview) -> None:
        started = time.perf_counter()
        self.inner.put(key, value)
        self._transfer(started, value.nbytes)

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        started = time.perf_counter()
        written = self.inner.replace(key, expected, value)  # the inner store's own conditional write
        self._transfer(started, value.nbytes)
        return written

    def _exists(self, key: str) -> bool:
        started = time.perf_counter()
        found = self.inner.exists(key)
        self._transfer(started, 0)
        return found

    def _delete(self, key: str) -> None:
        started = time.perf_counter()
        self.inner.delete(key)
        self._transfer(started, 0)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        started = time.perf_counter()
        values = self.inner.get_many(keys)
        self._transfer(started, sum(len(v) for v in values if v is not None))
        return values

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        started = time.perf_counter()
        self.inner.put_many(items)
        self._transfer(started, sum(v.nbytes for _, v in items))

    def _exists_many(self, keys: list[str]) -> list[bool]:
        started = time.perf_counter()
        found = self.inner.exists_many(keys)
        self._transfer(started, 0)
        return found

    def _keys(self, prefix: str) -> Iterator[str]:
        self._transfer(time.perf_counter(), 0)
        return self.inner.keys(prefix)

    def _close(self) -> None:
        self.inner.close()


def _link_url(inner: str, gbps: float, rtt_ms: float) -> str:
    sep = "&" if "?" in inner else "?"
    return f"link+{inner}{sep}gbps={gbps:g}&rtt_ms={rtt_ms:g}"


def from_url(url: str, open_inner: Callable[[str], Store]) -> LinkEmulator:
    """``link+<store url>?gbps=G[&rtt_ms=R]``: the link options are taken out, the rest opens the inner store."""
    inner, gbps, rtt_ms = _settings(url)
    return LinkEmulator(open_inner(inner), gbps=gbps, rtt_ms=rtt_ms)


def check_url(url: str, check_inner: Callable[[str], object]) -> None:
    """Refuse what :func:`from_url` would refuse, the inner store's URL included, without opening anything."""
    check_inner(_settings(url)[0])


def _settings(url: str) -> tuple[str, float, float]:
    """The inner store's URL, and the link's gbps and rtt_ms."""
    base, options = split_query(url[len("link+") :])
    if "gbps" not in options:
        raise StoreURLError(f"{redact_url(url)} needs gbps=<Gbit/s> (and optionally rtt_ms=<ms>)")
    gbps = parse_float("gbps", options.pop("gbps"), minimum=1e-9)
    rtt_ms = parse_float("rtt_ms", options.pop("rtt_ms", "0"))
    return with_query(base, options), gbps, rtt_ms
