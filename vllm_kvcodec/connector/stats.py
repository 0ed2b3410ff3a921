"""Counters of what the connector did: hits, tokens and bytes moved, time per stage, failures.

Each half keeps a :class:`ConnectorStats`; the worker half hands the interval's
counters to vLLM as :class:`KVCodecTransferStats` (vLLM aggregates them across
workers and logs them), and the totals stay readable for tests, benchmarks and
the demo.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


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


@dataclasses.dataclass
class KVCodecTransferStats(KVConnectorStats):
    """What vLLM's ``KVConnectorLogging`` receives from the worker each interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVCodecTransferStats":
        merged = Counter(self.data)
        merged.update(other.data)
        return KVCodecTransferStats(data=dict(merged))

    def reduce(self) -> dict[str, Any]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
