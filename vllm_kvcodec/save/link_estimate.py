"""The store's bandwidth as loads will meet it, from transfers that overlap and include latency.

What codec ``auto`` needs is the rate at which a load's reads arrive, and two
things make a transfer's own rate misread it:

- **Overlap.** The fetcher reads on several threads that share one link: four
  concurrent 8 MiB reads on a 100 Gbit/s link each take four times as long as
  one alone, so each reads as 25 Gbit/s. Counting bytes over the *union* of the
  recent transfers' intervals gives the link's rate whatever the concurrency.
- **Writes are not reads.** A saving instance's puts (a file store writing
  pages, an emulated link, a Redis appending) run far below what its reads
  will; with puts alone ``auto`` saved splitzip and zstd where raw loaded
  fastest (1.23x raw at 100 Gbit/s). Writes count only until the first read
  is seen (the worker reads a probe object at start-up for that).

Each transfer's time is taken net of the store's round trip (the least seen
by :meth:`LinkEstimate.observe_round_trip`): with 10 ms of latency a 3.9 MB
put took 13 ms, which read as 2.4 Gbit/s on a 10 Gbit/s link.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable

#: Transfers smaller than this say more about latency than bandwidth: not sampled.
MIN_SAMPLE_BYTES = 64 << 10
#: Recent transfers the estimate is taken over.
WINDOW = 16


class LinkEstimate:
    def __init__(self, initial_bytes_per_s: float, window: int = WINDOW) -> None:
        self._initial = initial_bytes_per_s
        self._samples: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=window)
        self._round_trip = 0.0
        self._reads_seen = False
        self._lock = threading.Lock()

    def observe_round_trip(self, seconds: float) -> None:
        """A store call that moved no bytes: the latency every later sample is net of (the least seen)."""
        if seconds > 0:
            with self._lock:
                self._round_trip = seconds if not self._round_trip else min(self._round_trip, seconds)

    def observe(self, nbytes: int, seconds: float, *, read: bool, end: float | None = None) -> None:
        """A transfer of ``nbytes`` that took ``seconds`` and ended at ``end`` (perf_counter; default: now)."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        end = time.perf_counter() if end is None else end
        with self._lock:
            if not read and self._reads_seen:
                return
            if read and not self._reads_seen:
                self._reads_seen = True
                self._samples.clear()  # writes told less than nothing once reads speak
            net = max(seconds - self._round_trip, 0.1 * seconds)
            self._samples.append((end - net, end, nbytes))

    @property
    def measured(self) -> bool:
        return bool(self._samples)

    @property
    def bytes_per_s(self) -> float:
        with self._lock:
            if not self._samples:
                return self._initial
            return sum(n for _, _, n in self._samples) / _union_length(self._samples)


def _union_length(intervals: Iterable[tuple[float, float, int]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end, _ in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
