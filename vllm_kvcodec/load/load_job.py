"""Bookkeeping of one load: which layer groups are in place, which blocks failed, cancellation.

A load is a set of stored objects (chunk x layer group). Layers become ready
group by group as their objects are scattered; a failed object does not block
readiness (its blocks are reported, and vLLM recomputes them). Cancellation
(the load timed out) waits for scatters in flight and forbids new ones, so a
late thread can never write into blocks vLLM is already recomputing.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from vllm_kvcodec.plans.outcomes import LoadOutcome


class LoadJob:
    def __init__(self, group_layers: list[list[int]], objects_per_group: int, req_ids: list[str]) -> None:
        self.req_ids = req_ids
        self.group_layers = group_layers
        self._remaining = [objects_per_group] * len(group_layers)
        self.layer_ready = {layer: threading.Event() for layers in group_layers for layer in layers}
        self.done = threading.Event()
        self.failed_blocks: set[int] = set()
        self.deadline = float("inf")
        self._pending: dict[tuple[int, int], tuple[str, str, list[int]]] = {}
        self._chunks: dict[str, dict[str, bool]] = {req_id: {} for req_id in req_ids}  # req -> chunk -> all ok so far
        self._cond = threading.Condition()
        self._writers = 0
        self.cancelled = False
        self.started = time.monotonic()
        self.fetch_s = 0.0  # seconds of its store round trips, summed over fetch threads
        self.cpu_s = 0.0  # thread-seconds of its decodes and scatters
        # Objects still pending per request, and who hears each request's load wall time (the load histogram).
        self._left: collections.Counter[str] = collections.Counter()
        self.on_request_loaded: Callable[[float], None] = lambda seconds: None
        if objects_per_group == 0:
            self._finish_all()

    def expect(self, group: int, obj: int, req_id: str, chunk_hash: str, block_ids: list[int]) -> None:
        self._pending[(group, obj)] = (req_id, chunk_hash, block_ids)
        self._left[req_id] += 1
        self._chunks.setdefault(req_id, {}).setdefault(chunk_hash, True)

    def outcomes(self) -> dict[str, LoadOutcome]:
        """Per request: the chunks now in place in every layer group, and the chunks that failed in any."""
        with self._cond:
            return {req_id: LoadOutcome([h for h, ok in chunks.items() if ok], [h for h, ok in chunks.items() if not ok])
                    for req_id, chunks in self._chunks.items()}

    def begin_write(self) -> bool:
        with self._cond:
            if self.cancelled:
                return False
            self._writers += 1
            return True

    def end_write(self) -> None:
        with self._cond:
            self._writers -= 1
            self._cond.notify_all()

    def object_done(self, group: int, obj: int, ok: bool) -> None:
        with self._cond:
            req_id, chunk_hash, blocks = self._pending.pop((group, obj), ("", "", []))
            if not ok:
                self._fail(req_id, chunk_hash, blocks)
            self._request_object_done(req_id)
            self._remaining[group] -= 1
            if self._remaining[group] == 0:
                for layer in self.group_layers[group]:
                    self.layer_ready[layer].set()
            if not any(self._remaining):
                self.done.set()

    def cancel(self) -> None:
        """Give up: everything not yet scattered counts as failed; returns after writers drain."""
        with self._cond:
            self.cancelled = True
            while self._writers:
                self._cond.wait()
            for req_id, chunk_hash, blocks in self._pending.values():
                self._fail(req_id, chunk_hash, blocks)
                self._request_object_done(req_id)
            self._pending.clear()
        self._finish_all()

    def _request_object_done(self, req_id: str) -> None:
        """Count one of the request's objects as settled; the last one reports the request's load time."""
        if req_id in self._left:
            self._left[req_id] -= 1
            if self._left[req_id] <= 0:
                del self._left[req_id]
                self.on_request_loaded(time.monotonic() - self.started)

    def _fail(self, req_id: str, chunk_hash: str, blocks: list[int]) -> None:
        self.failed_blocks.update(blocks)
        self._chunks.setdefault(req_id, {})[chunk_hash] = False

    def _finish_all(self) -> None:
        for event in self.layer_ready.values():
            event.set()
        self.done.set()

    def account(self, fetch_s: float = 0.0, cpu_s: float = 0.0) -> None:
        """Add a fetch's seconds, or an object's decode and scatter (threads report concurrently)."""
        with self._cond:
            self.fetch_s += fetch_s
            self.cpu_s += cpu_s

    def wait_all(self, deadline: float) -> bool:
        return self.done.wait(max(0.0, deadline - time.monotonic()))

    def wait_layer(self, layer: int, deadline: float) -> bool:
        return self.layer_ready[layer].wait(max(0.0, deadline - time.monotonic()))

    def settle(self) -> None:
        """Once ``done``: make the KV usable by the caller (nothing to do here; a GPU job orders streams)."""
