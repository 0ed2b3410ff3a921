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

from typing import TYPE_CHECKING

import torch

from vllm_kvcodec.paged.objects import ObjectLayout
from vllm_kvcodec.save.gather_base import SaveGather, SaveSink, SaveSpecLike, chunk_nbytes

if TYPE_CHECKING:
    from vllm_kvcodec.paged import PagedLayout


class CpuSaveGather(SaveGather):
    """Gather on the engine's thread with each layer's page layout, into one host buffer per chunk."""

    def __init__(self, caches: list[torch.Tensor], layouts: list["PagedLayout"], saver: SaveSink,
                 cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> None:
        super().__init__(caches, layouts, saver, cache_groups, objects)
        self._buffers: dict[int, torch.Tensor] = {}

    def _copy(self, index: int, layer: int, kv_layer: torch.Tensor, slots: list[int]) -> None:
        buf = self._buffers.get(index)
        if buf is None:
            buf = self._buffers[index] = torch.empty(self.chunk_shape(len(slots)), dtype=self.layouts[0].dtype)
        self.objects.read(self.layouts[layer], kv_layer, slots, buf[layer])

    def _hand_over(self, index: int, spec: SaveSpecLike, nbytes: int) -> None:
        self._submit(spec, self._buffers[index])

    def _finish_step(self) -> None:
        self._buffers.clear()


def save_gather_for(caches: list[torch.Tensor], layouts: list["PagedLayout"], saver: SaveSink,
                    cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> SaveGather:
    """The gather for where vLLM keeps the KV caches: a CUDA device, or host memory."""
    if caches[0].is_cuda:
        # Imported here, not at the top: it loads Triton, which a CPU engine never needs. No circle either
        # way: both gathers import their interface from gather_base.
        from vllm_kvcodec.save.cuda_gather import CudaSaveGather

        return CudaSaveGather(caches, layouts, saver, cache_groups, objects)
    return CpuSaveGather(caches, layouts, saver, cache_groups, objects)


__all__ = ["CpuSaveGather", "SaveGather", "SaveSink", "SaveSpecLike", "chunk_nbytes", "save_gather_for"]
