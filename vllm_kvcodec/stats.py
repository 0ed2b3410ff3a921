"""Counters of what the connector did (hits, tokens and bytes moved, time per stage, failures), and timing samples.

Each half of the connector, and the load and save paths it drives, add to a
:class:`ConnectorStats`; the worker half hands the interval's counters and
samples to vLLM (:mod:`vllm_kvcodec.connector.transfer_stats`), which feeds
its log line and the connector's Prometheus metrics
(:mod:`vllm_kvcodec.connector.prom_metrics`); the totals stay readable for
tests, benchmarks and the demo. No vLLM here: the load path runs without it
(the GPU device check).

Samples (one wall time per loaded request, per fetched object, ...) become
Prometheus histograms in vLLM's front-end process, so they travel with the
interval's data. They are bounded: at most :data:`MAX_SAMPLES` of each name are
kept per interval (vLLM takes one interval per engine step); samples past that
are counted in ``samples_dropped``, never held.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

#: Samples of one name kept per interval; a step that loads more objects than this drops the rest (counted).
MAX_SAMPLES = 4096
#: The key of the samples in an interval's data: ``{"samples": {name: [seconds, ...]}}``.
SAMPLES = "samples"


class ConnectorStats:
    """Thread-safe additive counters and bounded samples, with a per-interval view for vLLM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: Counter[str] = Counter()
        self._interval: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}

    def add(self, **values: float) -> None:
        with self._lock:
            self._total.update(values)
            self._interval.update(values)

    def sample(self, **values: float) -> None:
        """One observation per name (a histogram sample); dropped and counted once the interval holds MAX_SAMPLES."""
        with self._lock:
            for name, value in values.items():
                kept = self._samples.setdefault(name, [])
                if len(kept) < MAX_SAMPLES:
                    kept.append(value)
                else:
                    self._total["samples_dropped"] += 1
                    self._interval["samples_dropped"] += 1

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._total)

    def take_interval(self) -> dict[str, Any]:
        """Counters (and samples, under :data:`SAMPLES`) since the last call."""
        with self._lock:
            out: dict[str, Any] = dict(self._interval)
            if self._samples:
                out[SAMPLES] = self._samples
            self._interval, self._samples = Counter(), {}
            return out


class StoreTierCounters:
    """The growth of a store's per-tier counters (a ``cache+`` near tier's), as ``tier_<name>`` stats keys.

    Why here: the store counts what each tier did (it alone knows a near hit
    from a far read); the connector reports the growth of those totals with
    each interval, as it reports its own counters.
    """

    def __init__(self, store: object) -> None:
        self._root, self._store = store, None
        self._reported: dict[str, int] = {}

    def add_growth(self, stats: ConnectorStats) -> None:
        if self._store is None:  # looked for each time until found: an outage guard opens its store late
            store = self._root
            while store is not None and not hasattr(store, "tier_counters"):
                store = getattr(store, "inner", None)  # wrappers (outage guard, read-only) link to what they wrap
            if store is None:
                return
            self._store = store
        now = self._store.tier_counters()
        growth = {f"tier_{k}": v - self._reported.get(k, 0) for k, v in now.items() if v > self._reported.get(k, 0)}
        self._reported = now
        if growth:
            stats.add(**growth)


def counters(data: dict[str, Any]) -> dict[str, float]:
    """The counters of an interval's data, without its samples."""
    return {k: v for k, v in data.items() if k != SAMPLES}


def summarize(data: dict[str, Any]) -> dict[str, float]:
    """Counters plus the ratios an operator looks for first (samples are left out)."""
    out = counters(data)
    if out.get("saved_raw_bytes"):
        out["save_ratio"] = round(out["saved_raw_bytes"] / max(1, out.get("saved_bytes", 0)), 3)
    if out.get("loaded_raw_bytes"):
        out["load_ratio"] = round(out["loaded_raw_bytes"] / max(1, out.get("loaded_bytes", 0)), 3)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(out.items())}
