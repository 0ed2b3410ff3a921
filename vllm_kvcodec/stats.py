"""Counters of what the connector did: hits, tokens and bytes moved, time per stage, failures.

Each half of the connector, and the load and save paths it drives, add to a
:class:`ConnectorStats`; the worker half hands the interval's counters to vLLM
(:mod:`vllm_kvcodec.connector.transfer_stats`), and the totals stay readable
for tests, benchmarks and the demo. No vLLM here: the load path runs without it
(the GPU device check).
"""

from __future__ import annotations

import threading
from collections import Counter


class ConnectorStats:
    """Thread-safe additive counters, with a per-interval view for vLLM's logger."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: Counter[str] = Counter()
        self._interval: Counter[str] = Counter()

    def add(self, **values: float) -> None:
        with self._lock:
            self._total.update(values)
            self._interval.update(values)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._total)

    def take_interval(self) -> dict[str, float]:
        with self._lock:
            out, self._interval = dict(self._interval), Counter()
            return out


def summarize(data: dict[str, float]) -> dict[str, float]:
    """Counters plus the ratios an operator looks for first."""
    out = dict(data)
    if data.get("saved_raw_bytes"):
        out["save_ratio"] = round(data["saved_raw_bytes"] / max(1, data.get("saved_bytes", 0)), 3)
    if data.get("loaded_raw_bytes"):
        out["load_ratio"] = round(data["loaded_raw_bytes"] / max(1, data.get("loaded_bytes", 0)), 3)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(out.items())}
