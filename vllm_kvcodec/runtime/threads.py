"""The connector's own threads: pools started before the first request, each thread on one torch thread.

**Started at start-up.** ``concurrent.futures`` starts a pool's threads
lazily, one per ``submit``, so an engine's first load started its fetch and
decode threads (and ran their initializers) inside the request. Measured on 2
cores (SmolLM2, 4096-token raw prefix behind an emulated 100 Gbit/s link): the
first load's ``submit`` took 24 ms, later ones 0.1 ms. The connector builds its
pools when vLLM registers the KV caches, at start-up, where that cost goes
unnoticed.

**No OpenMP teams of their own.** A torch op that runs ``at::parallel_for`` on
a thread with more than one intra-op thread starts an OpenMP team for that
thread, and its workers stay. libgomp counts every team's threads: once they
outnumber the cores, it stops letting idle workers spin and puts them to sleep
at once (``GOMP_SPINCOUNT``'s throttled value), so each of the thousands of
small parallel regions in an engine step pays a futex wake. Measured on 2
cores (SmolLM2, a 4160-token local prefix-cache hit): after the first remote
hit the engine's own local hits went from 103-125 ms to 138-217 ms for the rest
of the process's life; elementwise ops (``Tensor.to``, RMS norm) ran 5x slower,
attention and GEMMs as before.

``torch.set_num_threads(1)`` does not prevent it inside vLLM: the CPU worker
replaces ``torch.set_num_threads`` with a no-op that logs a warning (it must
not rebind the engine's OpenMP threads). The builtin it shadows,
``torch._C.set_num_threads``, sets the calling thread's OpenMP thread count
(``omp_set_num_threads`` is per thread) and the default that threads which
have not yet run a parallel op will read; every thread the engine computes
on has run one long before the connector's pools start, at the profiling run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

#: How long start-up waits for a pool's threads to start before it goes on without them (they start lazily then).
START_TIMEOUT_S = 30.0


def started_pool(threads: int, name: str, initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``threads`` threads, every one of them started and initialized on return."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=initializer, initargs=initargs)
    # Each thread holds one task at the barrier, so the pool must start a thread per task (an idle one would
    # otherwise take the next task and no new thread would start).
    barrier = threading.Barrier(threads + 1)
    for _ in range(threads):
        pool.submit(barrier.wait, START_TIMEOUT_S)
    try:
        barrier.wait(START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # a thread that did not start in time starts on the pool's first task instead
    return pool


def one_torch_thread() -> None:
    """Pool initializer: this thread's torch ops run on it alone (parallelism comes from the pool)."""
    torch._C.set_num_threads(1)
