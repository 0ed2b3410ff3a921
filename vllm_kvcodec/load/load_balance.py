"""Whether recent loads were bound by the wire or by the CPU: what ``load_wait: auto`` decides by.

Waiting for a whole load before the prefill gives the load every core but
stops hiding the prefill under the transfer. It pays only where the load's
CPU work (decode and scatter, per thread that does it) outlasts its fetches
(per fetch thread): measured on 2 cores, rans at 10 and 100 Gbit/s went from
2.8 to 2.1-2.3 x the local hit waiting, while at 1 Gbit/s waiting cost 620 ms
against 548 ms beside the prefill (zstd 644 against 550). Each sync load's
own split is observed; the decision follows a running mean of their log
ratios, so one odd load does not flip it. Raw loads are judged alike: at 10
Gbit/s their copies hide under the wire (4096-token raw replay, 2 cores: 1.79x
the local hit beside the prefill against 1.94x waiting), at 100 Gbit/s they
do not (1.75x waiting against 1.81x beside it).
"""

from __future__ import annotations

import math
import threading

#: Weight of the newest load in the running mean of log(cpu / fetch).
WEIGHT = 0.3


class LoadBalance:
    def __init__(self) -> None:
        self._log_ratio: float | None = None
        self._lock = threading.Lock()

    def observe(self, fetch_s: float, fetch_threads: int, cpu_s: float, cpu_threads: int) -> None:
        """One finished load: wall seconds its fetches took, thread-seconds of its decode and scatter."""
        if fetch_s <= 0 or cpu_s <= 0:
            return
        sample = math.log((cpu_s / max(1, cpu_threads)) / (fetch_s / max(1, fetch_threads)))
        with self._lock:
            self._log_ratio = _mean(self._log_ratio, sample)

    @property
    def cpu_bound(self) -> bool | None:
        """True when recent loads spent longer decoding than fetching (None before the first)."""
        return None if self._log_ratio is None else self._log_ratio > 0.0


def _mean(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - WEIGHT) * current + WEIGHT * sample
