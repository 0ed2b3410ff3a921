"""The save gather on a GPU: paged KV -> device chunk buffer (side stream) -> pinned host memory -> the Saver.

``save_kv_layer`` runs inside the forward pass, on the engine's stream, right
after the layer wrote its KV. Here the side stream first waits for that stream
(so it reads the layer's fresh KV), then gathers the chunk's slots of that
layer into a device buffer ``[layers, 2, chunk, heads, head]`` (the Triton
gather through one pointer table for packed layouts, the layer's page layout
otherwise). At the end of the step each complete chunk gets one device-to-host
copy into pinned memory, and a small thread hands it to the Saver once the copy
has landed (encode and put stay as on the CPU). The engine's stream then waits
for the gathers *on the device*, so vLLM cannot reuse those blocks before they
are read: the engine thread never synchronises with the GPU. The blocks each
step read are recorded with that event (:class:`~vllm_kvcodec.gpu.block_reads.BlockReads`):
a load that vLLM hands those blocks after they are freed (a finished request's
tail is gathered in the step before) makes its own side stream wait for it.
Budget, admission and the end-of-step rules are :class:`~vllm_kvcodec.save.gather_base.SaveGather`'s.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_kvcodec.gpu.block_reads import BlockReads, layout_blocks
from vllm_kvcodec.gpu.scatter_triton import check_slots, packed_pages_for
from vllm_kvcodec.gpu.side_stream import SideStream
from vllm_kvcodec.plans.outcomes import SaveOutcome
from vllm_kvcodec.paged import PagedLayout
from vllm_kvcodec.paged.objects import ObjectLayout, PageObjects
from vllm_kvcodec.save.gather_base import SaveGather, SaveSink, SaveSpecLike

logger = logging.getLogger("vllm_kvcodec")


class CudaSaveGather(SaveGather):
    def __init__(self, caches: list[torch.Tensor], layouts: list[PagedLayout], saver: SaveSink,
                 cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> None:
        super().__init__(caches, layouts, saver, cache_groups, objects)
        self.side = SideStream(caches[0].device)
        self.pages = packed_pages_for(caches, layouts)
        self.num_slots = layouts[0].num_slots(caches[0])
        self._buffers: dict[int, torch.Tensor] = {}
        self._slots: dict[tuple[int, int], torch.Tensor] = {}  # (save index, cache group) -> device slots
        self.block_reads = BlockReads()  # what loads into the same blocks wait for (the worker hands it on)
        self._read: set[int] = set()  # the blocks this step's gathers read
        self._handoff = ThreadPoolExecutor(1, thread_name_prefix="kvcodec-d2h")

    def _copy(self, index: int, layer: int, kv_layer: torch.Tensor, slots: list[int]) -> None:
        a = self.layouts[layer]
        self.side.side_waits_for_compute()
        with self.side.active():
            if index not in self._buffers:
                self._buffers[index] = torch.empty(self.chunk_shape(len(slots)), dtype=a.dtype, device=kv_layer.device)
            key = (index, self.cache_groups[layer])
            if key not in self._slots:
                check_slots(slots, self.num_slots)
                self._slots[key] = torch.tensor(slots, dtype=torch.int64).to(kv_layer.device, non_blocking=True)
                self._read |= layout_blocks(slots, a.block_size)
            buf, dev_slots = self._buffers[index], self._slots[key]
            if isinstance(self.objects, PageObjects):  # whole pages: block copies on the device
                self.objects.read(a, kv_layer, slots, buf[layer])
            elif self.pages is not None and kv_layer.data_ptr() == self.caches[layer].data_ptr():
                self.pages.gather(layer, dev_slots, buf[layer : layer + 1])
            else:
                a.gather(kv_layer, dev_slots, out=buf[layer], check=False)

    def _hand_over(self, index: int, spec: SaveSpecLike, nbytes: int) -> None:
        """One D2H copy into pinned memory; the Saver gets the chunk once the copy has landed."""
        buf = self._buffers.pop(index)
        with self.side.active():
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=self.side.cuda)
            host.copy_(buf, non_blocking=True)
            copied = self.side.record()
        self._handoff.submit(self._to_saver, spec, host, copied, nbytes)

    def _to_saver(self, spec: SaveSpecLike, host: torch.Tensor, copied: torch.cuda.Event | None, nbytes: int) -> None:
        try:
            self.side.host_wait(copied)
            self._submit(spec, host)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            logger.warning("kvcodec: handing chunk %s to the saver failed: %s", spec.chunk_hash[:12], exc)
            self.saver.unreserve(nbytes)
            self.saver.report(SaveOutcome(spec.req_id, spec.chunk_hash, landed=False))

    def _finish_step(self) -> None:
        """Drop unsubmitted buffers; the engine's stream waits (on the device) for every gather so far, and so
        will any load into the blocks they read."""
        self._buffers.clear()
        self._slots.clear()
        read = self.side.record()
        self.side.compute_waits(read)
        self.block_reads.record(self._read, read)
        self._read = set()

    def flush(self) -> None:
        self._handoff.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._handoff.shutdown(wait=True)


__all__ = ["CudaSaveGather"]
