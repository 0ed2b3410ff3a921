"""The save path's first stage: copy the step's chunks out of paged memory, layer by layer, within the Saver's budget.

``save_kv_layer`` runs once per layer inside the forward pass, right after the
layer wrote its KV; waiting for the whole step would mean holding the blocks
longer or copying twice. So a gather collects each chunk to save layer by
layer into a chunk buffer (the object layout's shape) and, at the end
of the step (``wait_for_save``), hands every complete chunk to the
:class:`~vllm_kvcodec.save.saver.Saver`, which encodes and stores it in the
background.

Memory: the Saver owns the one byte budget (``max_pending_save_bytes``). A
chunk is *reserved* against it before its first layer is copied, so a long
prefill step cannot gather more than the budget holds; a chunk that does not
fit is dropped before any copy (counted), and a reservation whose chunk is not
handed over (incomplete, or computed over a failed load) is given back.

:class:`CpuSaveGather` copies with the layer's page layout on the engine's
thread; :class:`~vllm_kvcodec.save.cuda_gather.CudaSaveGather` copies on a
side stream and moves finished chunks to pinned host memory. :func:`save_gather_for`
picks one for the caches vLLM registered.

Each layer belongs to one vLLM KV cache group (``cache_groups[layer]``) and is
gathered from that group's slots of the chunk (``spec.group_slots``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvcodec.paged.objects import CanonicalObjects, ObjectLayout

if TYPE_CHECKING:
    from vllm_kvcodec.paged import PagedLayout

#: ``(req_id, chunk_hash, group_slots)`` of one chunk to save (a :class:`~vllm_kvcodec.connector.metadata.SaveSpec`).
SaveSpecLike = Any


def chunk_nbytes(layouts: Sequence["PagedLayout"], tokens: int) -> int:
    """Raw bytes one worker gathers for ``tokens`` of every layer (what the save budget counts)."""
    return len(layouts) * tokens * layouts[0].token_nbytes()


class SaveGather(abc.ABC):
    def __init__(self, caches: list[torch.Tensor], layouts: list["PagedLayout"], saver: Any,
                 cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> None:
        self.caches, self.layouts, self.saver = caches, layouts, saver
        self.cache_groups = cache_groups or [0] * len(caches)  # the vLLM KV cache group of each layer
        self.objects = objects if objects is not None else CanonicalObjects()  # what one stored object holds
        self._step: Sequence[SaveSpecLike] | None = None
        self._admitted: dict[int, int] = {}  # save index -> reserved bytes
        self._layers_done: dict[int, int] = {}

    def chunk_nbytes(self, tokens: int) -> int:
        return chunk_nbytes(self.layouts, tokens)

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        """All layers of one chunk, as the object layout stores them (split into layer groups by the Saver)."""
        return self.objects.object_shape(len(self.caches), self.layouts[0], self.caches[0], tokens)

    # ---- per layer (save_kv_layer) --------------------------------------------------
    def gather_layer(self, layer: int, kv_layer: torch.Tensor, saves: Sequence[SaveSpecLike]) -> None:
        """Copy this layer's slots of every admitted chunk of the step."""
        if self._step is not saves:
            self._begin(saves)
        group = self.cache_groups[layer]
        for i in self._admitted:
            self._copy(i, layer, kv_layer, saves[i].group_slots[group])
            self._layers_done[i] = self._layers_done.get(i, 0) + 1

    def _begin(self, saves: Sequence[SaveSpecLike]) -> None:
        self._step, self._admitted, self._layers_done = saves, {}, {}
        for i, spec in enumerate(saves):
            nbytes = self.chunk_nbytes(len(spec.group_slots[0]))
            if self.saver.reserve(nbytes):
                self._admitted[i] = nbytes

    # ---- end of step (wait_for_save) ------------------------------------------------
    def end_step(self, saves: Sequence[SaveSpecLike], good: Callable[[SaveSpecLike], bool]) -> list[tuple[SaveSpecLike, str]]:
        """Hand complete chunks whose KV is ``good`` to the Saver; return the others with why they were not."""
        if self._step is not saves:
            self._begin(saves)  # a step whose forward saved no layer (nothing was gathered)
        left: list[tuple[SaveSpecLike, str]] = []
        for i, spec in enumerate(saves):
            nbytes = self._admitted.get(i)
            complete = nbytes is not None and self._layers_done.get(i, 0) == len(self.caches)
            if complete and good(spec):
                self._hand_over(i, spec, nbytes)
                continue
            if nbytes is not None:
                self.saver.unreserve(nbytes)
            reason = "no room" if nbytes is None else ("incomplete" if not complete else "load failed")
            left.append((spec, reason))
        self._finish_step()
        self._step, self._admitted, self._layers_done = None, {}, {}
        return left

    @abc.abstractmethod
    def _copy(self, index: int, layer: int, kv_layer: torch.Tensor, slots: list[int]) -> None: ...

    @abc.abstractmethod
    def _hand_over(self, index: int, spec: SaveSpecLike, nbytes: int) -> None: ...

    def _finish_step(self) -> None:
        """Release per-step buffers (and, on a GPU, order the engine's stream after the gathers)."""

    def flush(self) -> None:
        """Wait until every handed-over chunk is on the Saver's queue."""

    def shutdown(self) -> None:
        """Stop background hand-off threads, if any."""


class CpuSaveGather(SaveGather):
    """Gather on the engine's thread with each layer's page layout, into one host buffer per chunk."""

    def __init__(self, caches: list[torch.Tensor], layouts: list["PagedLayout"], saver: Any,
                 cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> None:
        super().__init__(caches, layouts, saver, cache_groups, objects)
        self._buffers: dict[int, torch.Tensor] = {}

    def _copy(self, index: int, layer: int, kv_layer: torch.Tensor, slots: list[int]) -> None:
        buf = self._buffers.get(index)
        if buf is None:
            buf = self._buffers[index] = torch.empty(self.chunk_shape(len(slots)), dtype=self.layouts[0].dtype)
        self.objects.read(self.layouts[layer], kv_layer, slots, buf[layer])

    def _hand_over(self, index: int, spec: SaveSpecLike, nbytes: int) -> None:
        self.saver.submit(spec.chunk_hash, self._buffers[index], spec.req_id, reserved=True, tokens=spec.tokens)

    def _finish_step(self) -> None:
        self._buffers.clear()


def save_gather_for(caches: list[torch.Tensor], layouts: list["PagedLayout"], saver: Any,
                    cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> SaveGather:
    """The gather for where vLLM keeps the KV caches: a CUDA device, or host memory."""
    if caches[0].is_cuda:
        from vllm_kvcodec.save.cuda_gather import CudaSaveGather

        return CudaSaveGather(caches, layouts, saver, cache_groups, objects)
    return CpuSaveGather(caches, layouts, saver, cache_groups, objects)
