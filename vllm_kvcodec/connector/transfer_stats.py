"""The connector's counters and samples as vLLM's ``KVConnectorStats``: what each side hands vLLM per step.

vLLM merges the workers' and the scheduler's objects with :meth:`aggregate`,
ships ``data`` to its front-end process, and there feeds it to the
connector's Prometheus metrics (every step) and to its ``KV Transfer
metrics:`` log line (accumulated over the log interval, then :meth:`reduce`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_kvcodec.stats import MAX_SAMPLES, SAMPLES, counters, summarize


@dataclasses.dataclass
class KVCodecTransferStats(KVConnectorStats):
    """``data``: additive counters, plus ``{"samples": {name: [seconds, ...]}}`` (see vllm_kvcodec.stats)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVCodecTransferStats":
        merged = Counter(counters(self.data))
        merged.update(counters(other.data))
        samples, dropped = merge_samples(self.data.get(SAMPLES, {}), other.data.get(SAMPLES, {}))
        if dropped:
            merged["samples_dropped"] += dropped
        data: dict[str, Any] = dict(merged)
        if samples:
            data[SAMPLES] = samples
        return KVCodecTransferStats(data=data)

    def reduce(self) -> dict[str, Any]:
        out = summarize(self.data)
        for name, values in sorted(self.data.get(SAMPLES, {}).items()):
            if values:
                ordered = sorted(values)
                out[f"{name}_p50_ms"] = round(ordered[len(ordered) // 2] * 1e3, 3)
                out[f"{name}_max_ms"] = round(ordered[-1] * 1e3, 3)
        return out

    def is_empty(self) -> bool:
        return not any(counters(self.data).values()) and not any(self.data.get(SAMPLES, {}).values())


def merge_samples(a: dict[str, list[float]], b: dict[str, list[float]]) -> tuple[dict[str, list[float]], int]:
    """Both sets of samples, at most MAX_SAMPLES per name (the log line accumulates many steps), and how many were cut."""
    merged: dict[str, list[float]] = {}
    dropped = 0
    for name in {*a, *b}:
        values = [*a.get(name, ()), *b.get(name, ())]
        dropped += max(0, len(values) - MAX_SAMPLES)
        merged[name] = values[:MAX_SAMPLES]
    return merged, dropped
