"""How many threads a load fetches and decodes on: the cores a CPU engine's own threads leave idle.

A CPU engine runs its forward pass on ``torch.get_num_threads()`` OpenMP
threads, usually one per core. A remote hit's decode and scatter run while
that forward pass computes the uncached suffix, so a decode thread beyond the
idle cores adds no throughput: it takes a core from the prefill and both wait
in the run queue. A read from a store on this host (file, memory) is a memory
copy, CPU work like a decode, so there fetching takes no more threads either;
a network store's reads mostly wait, and several stay in flight.

Measured on 2 cores (SmolLM2, 4096-token raw prefix from the file store,
replay TTFT over the local hit in the same engine, median of 25 pairs, two
rounds): 4 threads fetching and decoding 1.33 and 1.33; 4 fetching, 1
decoding 1.28 and 1.30; 1 thread for both 1.15 and 1.22. The load alone, engine
idle: 104 CPU-ms with 4 threads, 56 with one. A GPU engine leaves the host's
cores to the connector, so there every fetch thread decodes.

Those figures predate :mod:`vllm_kvcodec.runtime.threads` (every extra thread
then also slowed the engine's own OpenMP team). After it, TTFT over the local
hit at 10 / 100 Gbit/s, 5 pairs a row: one thread beside the prefill, layer
by layer, raw 1.44 / 1.34; two threads beside it, raw 1.56 / 1.32, rans 2.78 /
2.76; the prefill waiting for the whole load, one thread: raw 1.84 / 1.39,
rans 2.89 / 2.90; two threads: raw 1.74 / 1.58, rans 2.13 / 2.30. Waiting
loses the wire time a light decoder hides under the prefill and wins where
decode dominates. So ``load_wait: auto`` waits while recent loads were
decode-bound (:mod:`.load_balance`), and a CPU engine that leaves no core
idle decodes on every core (beside the prefill, two threads read as one did
for raw: 1.56 / 1.32 against 1.44 / 1.34).

Since loads copy pages without tensors (``direct_read``), on a 2-core
Intel Xeon with AMX, little memory bandwidth per core, one thread doing everything beat
this policy's 2 decode and 4 fetch threads for raw at 100 Gbit/s (1.55 against
1.75 x the local hit, waiting for the whole load; docs/benchmarks.md). Left as
it is on one VM's evidence: the extra threads are for hosts with the bandwidth
and for networks that wait.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

#: Fetch threads for a store whose reads wait on a network: round trips in flight at once.
NETWORK_FETCH_THREADS = 4


class LoadThreads(NamedTuple):
    fetch: int
    decode: int


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def idle_cores() -> int:
    """Cores a CPU engine's own OpenMP threads leave to the connector (0 when they take every core)."""
    return max(0, usable_cores() - torch.get_num_threads())


def load_threads(fetch: int | None, decode: int | None, *, on_device: bool, reads_in_memory: bool,
                 whole_loads: bool = False) -> LoadThreads:
    """The configured counts, with each unset one chosen as the module docstring explains.

    ``whole_loads``: the prefill may wait for a whole load, which then has
    every core of a CPU engine to decode on.
    """
    if decode is None:
        if on_device:
            decode = fetch or NETWORK_FETCH_THREADS
        else:
            decode = usable_cores() if whole_loads and idle_cores() == 0 else max(1, idle_cores())
    if fetch is None:
        fetch = decode if reads_in_memory and not on_device else max(decode, NETWORK_FETCH_THREADS)
    return LoadThreads(fetch, decode)
