"""Keep the connector's own threads from starting OpenMP teams of their own.

A torch op that runs ``at::parallel_for`` on a thread with more than one
intra-op thread starts an OpenMP team for that thread, and its workers stay.
libgomp counts every team's threads: once they outnumber the cores, it stops
letting idle workers spin and puts them to sleep at once (``GOMP_SPINCOUNT``'s
throttled value), so each of the thousands of small parallel regions in an
engine step pays a futex wake. Measured on 2 cores (SmolLM2, a 4160-token
local prefix-cache hit): after the first remote hit the engine's own local
hits went from 103-125 ms to 138-217 ms for the rest of the process's life;
elementwise ops (``Tensor.to``, RMS norm) ran 5x slower, attention and GEMMs
as before.

``torch.set_num_threads(1)`` does not prevent it inside vLLM: the CPU worker
replaces ``torch.set_num_threads`` with a no-op that logs a warning (it must
not rebind the engine's OpenMP threads). The builtin it shadows,
``torch._C.set_num_threads``, sets the calling thread's OpenMP thread count
(``omp_set_num_threads`` is per thread) and the default that threads which
have not yet run a parallel op will read; every thread the engine computes
on has run one long before the connector's pools start, at the profiling run.
"""

from __future__ import annotations

import torch


def one_torch_thread() -> None:
    """Pool initializer: this thread's torch ops run on it alone (parallelism comes from the pool)."""
    torch._C.set_num_threads(1)
