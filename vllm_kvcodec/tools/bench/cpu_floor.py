"""The CPU floor under a TTFT: what a request's CPU work allows on this machine's cores.

Why: on a small CPU host the load path and vLLM's prefill share the same
cores, so a TTFT target can sit below what the work itself permits. A
request that spends ``c`` CPU-seconds (the whole process: the engine runs
in-process in the benchmarks, with the connector's threads) on ``n`` usable
cores cannot take less than ``c / n`` seconds of wall time, however well its
parts overlap. Set beside the local hit of the same pair, that floor says
whether a ratio target can be met by scheduling alone or needs less work.
The CPU counted is as spent, spinning included (vLLM's OpenMP team spins in
its barriers, and a local hit on 2 cores spends close to 2 CPU-seconds per
second), so it is a floor for this engine as configured, not for any engine.
"""

from __future__ import annotations

import os
import statistics


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which may be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_floor(cpu_s: list[float], local_hit_s: list[float]) -> dict[str, float]:
    """Per timed load: its CPU-seconds, and its floor (CPU over the cores) over the paired local hit; medians."""
    cores = usable_cores()
    return {"cpu_s": statistics.median(cpu_s), "cpu_all_s": cpu_s,
            "floor_over_local": statistics.median(c / cores / h for c, h in zip(cpu_s, local_hit_s))}
