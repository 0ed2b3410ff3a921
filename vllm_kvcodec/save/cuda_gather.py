"""The save path's gather on a GPU: paged KV -> device chunk buffer -> pinned host memory -> the Saver.

``save_kv_layer`` runs inside the forward pass, on the engine's stream, right
after the layer wrote its KV. Here the side stream first waits for that
stream (so it reads the layer's fresh KV), then gathers the chunk's slots of
that layer into a device buffer ``[layers, 2, chunk, heads, head]`` (the Triton
gather for packed layouts, the layer's adapter otherwise). ``submit`` (from
``wait_for_save``) enqueues one device-to-host copy per chunk into pinned
memory and hands it to a small thread that waits for that copy and then
queues the chunk on the :class:`~vllm_kvcodec.save.saver.Saver` (encode and put stay
as on the CPU). ``release`` makes the engine's stream wait for the gathers on
the device, so vLLM cannot reuse those blocks before they are read: the engine
thread never synchronises with the GPU.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vllm_kvcodec.gpu.scatter_triton import PackedPages, check_slots
from vllm_kvcodec.gpu.side_stream import SideStream
from vllm_kvcodec.outcomes import SaveOutcome
from vllm_kvcodec.paged import PagedKVAdapter

logger = logging.getLogger("vllm_kvcodec")


class CudaSaveGather:
    def __init__(self, caches: list[torch.Tensor], adapters: list[PagedKVAdapter], side: SideStream,
                 pages: PackedPages | None, saver: Any) -> None:
        self.caches, self.adapters, self.side, self.pages, self.saver = caches, adapters, side, pages, saver
        self.num_slots = adapters[0].num_slots(caches[0])
        self._buffers: dict[int, torch.Tensor] = {}
        self._slots: dict[int, torch.Tensor] = {}
        self._handoff = ThreadPoolExecutor(1, thread_name_prefix="kvcodec-d2h")

    def gather(self, index: int, layer: int, kv_layer: torch.Tensor, slots: list[int]) -> None:
        """Copy ``slots`` of one layer into save ``index``'s device buffer, on the side stream."""
        a = self.adapters[layer]
        self.side.side_waits_for_compute()
        with self.side.active():
            if index not in self._buffers:
                check_slots(slots, self.num_slots)
                shape = (len(self.caches), 2, len(slots), a.num_kv_heads, a.head_size)
                self._buffers[index] = torch.empty(shape, dtype=a.dtype, device=kv_layer.device)
                self._slots[index] = torch.tensor(slots, dtype=torch.int64).to(kv_layer.device, non_blocking=True)
            buf, dev_slots = self._buffers[index], self._slots[index]
            if self.pages is not None and kv_layer.data_ptr() == self.caches[layer].data_ptr():
                self.pages.gather(layer, dev_slots, buf[layer : layer + 1])
            else:
                a.gather(kv_layer, dev_slots, out=buf[layer], check=False)

    def submit(self, index: int, chunk_hash: str, req_id: str = "") -> None:
        """One D2H copy of save ``index`` into pinned memory; the Saver gets it once the copy has landed."""
        buf = self._buffers.pop(index)
        self._slots.pop(index, None)
        with self.side.active():
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=self.side.cuda)
            host.copy_(buf, non_blocking=True)
            copied = self.side.record()
        self._handoff.submit(self._hand_over, chunk_hash, host, copied, req_id)

    def _hand_over(self, chunk_hash: str, host: torch.Tensor, copied: torch.cuda.Event | None, req_id: str) -> None:
        try:
            self.side.host_wait(copied)
            self.saver.submit(chunk_hash, host, req_id)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            logger.warning("kvcodec: handing chunk %s to the saver failed: %s", chunk_hash[:12], exc)
            self.saver.report(SaveOutcome(req_id, chunk_hash, landed=False))

    def release(self) -> None:
        """Drop unsubmitted buffers; the engine's stream waits (on the device) for every gather so far."""
        self._buffers.clear()
        self._slots.clear()
        self.side.compute_waits(self.side.record())

    def flush(self) -> None:
        """Wait until every submitted chunk is on the Saver's queue (tests, shutdown)."""
        self._handoff.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._handoff.shutdown(wait=True)


__all__ = ["CudaSaveGather"]
