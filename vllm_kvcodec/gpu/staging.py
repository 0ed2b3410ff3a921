"""Host staging buffers for host-to-device copies: a bounded pool, pinned where a GPU is.

A copy from pageable memory to the GPU is staged by the driver and blocks the
calling thread; from page-locked (pinned) memory it is a DMA the side stream
runs while the thread goes on. Pinning is slow (``cudaHostAlloc``, milliseconds),
so buffers are kept and reused: one per fetch thread (each thread holds at most
one object), grown when a bigger object comes, so host memory stays bounded by
``count x`` the largest object seen. A buffer goes back to the pool only once
the copies that read it have finished (the caller's business: the fetcher
waits on its copy event before leaving :meth:`StagingPool.take`).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vllm_kvcodec.errors import ConfigError

GRANULE = 1 << 20  # buffers grow in whole MiB, so slightly bigger objects reuse them


class StagingPool:
    def __init__(self, count: int, *, pin: bool) -> None:
        if count < 1:
            raise ConfigError(f"a staging pool needs at least one buffer, got {count}")
        self.count, self.pin = count, pin
        self._free: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(None)  # allocated on first use, at the size first needed
        self.allocations = 0

    @contextmanager
    def take(self, nbytes: int, timeout: float | None = None) -> Iterator[torch.Tensor]:
        """A uint8 host tensor of exactly ``nbytes`` (a view of a pooled buffer), returned on exit.

        Blocks while all buffers are taken (``timeout`` seconds at most, then
        :class:`TimeoutError`).
        """
        try:
            buf = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no staging buffer free within {timeout} s") from None
        try:
            if buf is None or buf.numel() < nbytes:
                buf = None  # drop the small one before pinning a bigger one
                buf = self._alloc(nbytes)
            yield buf[:nbytes]
        finally:
            self._free.put(buf)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)


def host_slots(staging: torch.Tensor, at: int, slots: list[int]) -> torch.Tensor:
    """Write ``slots`` as int64 into ``staging[at:]`` (8-byte aligned) and return that view."""
    if at % 8:
        raise ValueError(f"slot offset {at} is not 8-byte aligned")
    view = staging[at : at + 8 * len(slots)].view(torch.int64)
    view.copy_(torch.as_tensor(slots, dtype=torch.int64))
    return view


def align8(n: int) -> int:
    return align(n, 8)


def align(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (a section's offset in a staging buffer)."""
    return -(-n // to) * to
