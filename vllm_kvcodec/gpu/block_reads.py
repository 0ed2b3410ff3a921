"""The paged blocks the save path's side stream may still be reading, and the event that marks the end of each read.

Why: a finished request's tail is gathered on the save gather's side stream
(:mod:`vllm_kvcodec.save.cuda_gather`) in the step after it ended, while vLLM
holds its blocks; once the worker reports it finished sending, vLLM frees
them, and the next step may hand them to a load. A load writes on the load
path's own side stream (:mod:`vllm_kvcodec.load.cuda_placement`), which
nothing ordered after the gather: the engine's stream waits for the gathers,
but the load does not run there. On a busy GPU the load's scatter could land
before the gather read the blocks, and the tail would be stored, under its
key, with another request's KV. So the gather records, per block it read, the
event that marks its reads, and a load makes its side stream wait on the
device (no host synchronisation) for the events of the blocks it is about to
write, before any of its work is enqueued there.

Blocks are counted in each group's layout blocks (``slot // block_size``), the
same way on both sides. Events of one stream complete in the order they were
recorded, so those done are forgotten from the oldest on. Used from the
engine's thread only (``wait_for_save`` records, ``start_load_kv`` asks). On a
CPU device copies finish before they return: no event is recorded, and
nothing ever waits.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Protocol


class ReadEvent(Protocol):
    """What is needed of a ``torch.cuda.Event`` here: whether the work before it has run."""

    def query(self) -> bool: ...


class BlockReads:
    def __init__(self) -> None:
        self._last: dict[int, ReadEvent] = {}  # block -> the event after the last gather that read it
        self._recorded: collections.deque[tuple[ReadEvent, list[int]]] = collections.deque()  # oldest first

    def record(self, blocks: Iterable[int], event: ReadEvent | None) -> None:
        """Gathers reading ``blocks`` were enqueued before ``event`` (None: nothing to order, a CPU device)."""
        blocks = list(blocks)
        if event is None or not blocks:
            return
        self._forget_done()
        for b in blocks:
            self._last[b] = event
        self._recorded.append((event, blocks))

    def pending(self, blocks: Iterable[int]) -> list[ReadEvent]:
        """The events a write of ``blocks`` must wait for: those of reads of any of them that may still run."""
        self._forget_done()
        events: dict[int, ReadEvent] = {}
        for b in blocks:
            if (event := self._last.get(b)) is not None:
                events[id(event)] = event
        return list(events.values())

    def __len__(self) -> int:
        """Blocks whose last read may still be running."""
        return len(self._last)

    def _forget_done(self) -> None:
        while self._recorded and self._recorded[0][0].query():
            event, blocks = self._recorded.popleft()
            for b in blocks:
                if self._last.get(b) is event:
                    del self._last[b]


def layout_blocks(slots: Iterable[int], block_size: int) -> set[int]:
    """The blocks (of ``block_size`` tokens) that hold ``slots``."""
    return {s // block_size for s in slots}


__all__ = ["BlockReads", "ReadEvent", "layout_blocks"]
