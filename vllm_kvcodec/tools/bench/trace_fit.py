"""This machine's prefill costs, fitted to a replay through the simulator's own queues: what its TTFT model needs.

The simulator prices a request as ``overhead + max(load, prefill)``, prefill
``s_per_token * n + s_per_token2 * ((p + n)**2 - p**2) / 2`` for ``n`` computed
tokens after ``p`` cached ones, and makes it wait behind the earlier requests
of its worker (:class:`~.trace_sim.WorkerQueues`). Under load most of a replay's
TTFT is that wait, so the three coefficients are fitted with the queue in the
loop: on one configuration's requests (their arrival, worker and measured
split), minimising the mean absolute log error of TTFT with a pattern search in
log space (no scipy here). Then the simulator, given the same costs, predicts
the other configurations' TTFT, and :func:`ttft_error` says how far off it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_kvcodec.tools.bench.trace_sim import queue_ttft

#: Where the search starts (seconds per request, per token, per token squared) and its floor.
START = (0.05, 5e-4, 5e-7)
FLOOR = 1e-12
#: Every move of -1, 0 or +1 step on each axis (but not none): costs trade off against each other.
DIRECTIONS = [np.array(v, dtype=float) - 1 for v in np.ndindex(3, 3, 3) if v != (1, 1, 1)]


def fit_costs(arrivals: Sequence[float], workers: Sequence[int], computed: Sequence[int], cached: Sequence[int],
              ttfts: Sequence[float], n_workers: int) -> dict[str, float]:
    """overhead_s, s_per_token, s_per_token2 whose queued TTFT best matches ``ttfts`` (requests in arrival order)."""
    n = np.asarray(computed, dtype=float)
    end = n + np.asarray(cached, dtype=float)
    attention = (end**2 - np.asarray(cached, dtype=float) ** 2) / 2
    measured = np.maximum(np.asarray(ttfts, dtype=float), 1e-4)

    def loss(logs: np.ndarray) -> float:
        overhead, per_token, per_token2 = 10.0**logs
        model = queue_ttft(arrivals, workers, per_token * n + per_token2 * attention, n_workers, overhead)
        return float(np.mean(np.abs(np.log(np.maximum(model, 1e-4) / measured))))

    logs = np.log10(np.array(START))
    best, step = loss(logs), 1.0
    while step > 0.002:
        improved = False
        for direction in DIRECTIONS:
            trial = np.maximum(logs + step * direction, math.log10(FLOOR))
            value = loss(trial)
            if value < best - 1e-12:
                logs, best, improved = trial, value, True
        if not improved:
            step /= 2
    overhead, per_token, per_token2 = (float(v) for v in 10.0**logs)
    return {"overhead_s": overhead, "s_per_token": per_token, "s_per_token2": per_token2,
            "mean_abs_log_error": best, "requests": len(measured)}


def ttft_error(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, Any]:
    """How far modelled TTFTs are from measured ones: at p50, p90, and per request (median relative error)."""
    model, real = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    keep = real > 0
    model, real = model[keep], real[keep]
    if not len(real):
        return {"compared": False}
    out: dict[str, Any] = {"compared": True, "requests": int(len(real))}
    for q in (50, 90):
        m, r = float(np.percentile(model, q)), float(np.percentile(real, q))
        out[f"p{q}_measured_s"], out[f"p{q}_predicted_s"], out[f"p{q}_error"] = r, m, m / r - 1
    out["median_relative_error"] = float(np.median(np.abs(model - real) / real))
    return out
