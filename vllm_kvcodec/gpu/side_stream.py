"""The one side stream the GPU load and save paths run on, and the events that order it against compute.

Kept small on purpose: everything that needs a GPU to be tested lives here.
On a CPU device (the Triton interpreter, in tests) kernels and copies finish
before they return, so there is nothing to order: the same calls are no-ops
and the load path above them runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SideStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make the side stream current in this thread (kernels, copies and allocations go there)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything enqueued on the side stream so far.

        Blocking-sync: an I/O thread that waits on it sleeps in the driver
        instead of spinning a core per object (the default event spins).
        """
        if self.stream is None:
            return None
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    @staticmethod
    def host_wait(event: torch.cuda.Event | None) -> None:
        """Block this (I/O) thread until ``event`` has passed; never called on the engine's thread."""
        if event is not None:
            event.synchronize()

    def compute_waits(self, event: torch.cuda.Event | None) -> None:
        """Make the caller's current stream wait for ``event`` on the device (no host synchronisation)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def side_waits_for(self, events: list[torch.cuda.Event]) -> None:
        """Make the side stream wait on the device for ``events`` of other streams: what is enqueued on it from now
        on runs after them (no host synchronisation)."""
        if self.stream is not None:
            for event in events:
                self.stream.wait_event(event)

    def side_waits_for_compute(self) -> None:
        """Make the side stream wait for what the caller's current stream has enqueued (e.g. a layer's KV writes)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
