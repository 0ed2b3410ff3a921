"""The load path's placement on a GPU: pinned staging -> H2D, decode, scatter on a side stream.

The :class:`~vllm_kvcodec.load.fetcher.Fetcher` fetches and validates each
object on its I/O threads as for host memory; this placement supplies the rest:

1. Into a pinned staging buffer (:class:`~vllm_kvcodec.gpu.staging.StagingPool`,
   one per thread): the bf16 ``splitzip`` payload as is, or, for every other
   codec, the tensor the CPU codec decodes; plus the slots (the scheduler's
   list, checked on the host: no device sync).
2. On the side stream: H2D copies, then the Triton SplitZip decode (device-
   side validation flags copied back into the staging buffer), then an event
   the *I/O thread* waits on: the staging buffer is free again and the flags
   are read. A payload that fails its checks is never scattered.
3. On the side stream: the Triton scatter of the whole layer group
   (:class:`~vllm_kvcodec.gpu.scatter_triton.PackedPages`, one launch) or, for
   layouts it does not cover and for layers of several vLLM KV cache groups
   (each with its own slots), each layer's page layout (torch indexing, on the device).
4. When the last object of a layer group is enqueued, one CUDA event is
   recorded for the group (:class:`CudaLoadJob`); ``wait_layer`` waits on the
   host only until that event *exists*, then makes the engine's current stream
   wait on it on the device: the engine's thread never synchronises with the GPU.

Cancellation (the deadline passed) forbids new scatters as on the host, then
makes the engine's stream wait for those already enqueued, so none can land
after vLLM starts recomputing those blocks.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from storage import Store
from vllm_kvcodec.dtypes import DType
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.format import ChunkHeader, decode_payload, payload_of
from vllm_kvcodec.gpu.launch import can_run_on
from vllm_kvcodec.gpu.scatter_triton import check_slots, packed_pages_for
from vllm_kvcodec.gpu.side_stream import SideStream
from vllm_kvcodec.gpu.staging import StagingPool, align8, host_slots
from vllm_kvcodec.keys import ObjectAddresses
from vllm_kvcodec.gpu import splitzip_triton as sz
from vllm_kvcodec.load.fetcher import Decoded, Fetcher, Placement
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.paged import PagedLayout
from vllm_kvcodec.paged.objects import PageObjects
from vllm_kvcodec.spans import Span

FLAG_BYTES = 8  # two int32 device validation flags of a SplitZip decode


class CudaLoadJob(LoadJob):
    """A :class:`LoadJob` whose layers are ready on the device through one CUDA event per layer group."""

    def __init__(self, side: SideStream, group_layers: list[list[int]], objects_per_group: int,
                 req_ids: list[str]) -> None:
        self.side = side
        self.group_of = {layer: g for g, layers in enumerate(group_layers) for layer in layers}
        self.events: list[torch.cuda.Event | None] = [None] * len(group_layers)
        self._enqueue_left = [objects_per_group] * len(group_layers)
        super().__init__(group_layers, objects_per_group, req_ids)

    def object_done(self, group: int, obj: int, ok: bool) -> None:
        # Record the group's event before this object counts: whichever call makes the group
        # ready comes after the record, so a ready layer always has its event.
        with self._cond:
            self._enqueue_left[group] -= 1
            if self._enqueue_left[group] == 0:
                self.events[group] = self.side.record()
        super().object_done(group, obj, ok)

    def wait_layer(self, layer: int, deadline: float) -> bool:
        if not super().wait_layer(layer, deadline):
            return False
        self.side.compute_waits(self.events[self.group_of[layer]])
        return True

    def cancel(self) -> None:
        super().cancel()  # no new scatter after this; those in flight are enqueued
        self.side.compute_waits(self.side.record())

    def settle(self) -> None:
        """The caller's stream waits for every group (call once ``done`` is set, before using the blocks)."""
        for event in self.events:
            self.side.compute_waits(event)


class CudaPlacement(Placement):
    """Decode and scatter on the device of the caches (or, for tests, a CPU in Triton's interpreter)."""

    def __init__(self, caches: list[torch.Tensor], layouts: list[PagedLayout], threads: int,
                 cache_groups: list[int] | None = None) -> None:
        super().__init__(caches, layouts, cache_groups)
        self.device = caches[0].device
        if not can_run_on(self.device):
            raise ConfigError(f"the GPU load path cannot run Triton kernels on {self.device} in this process")
        self.side = SideStream(self.device)
        self.pages = packed_pages_for(caches, layouts)
        self.num_slots = layouts[0].num_slots(caches[0])
        self.staging = StagingPool(threads, pin=self.device.type == "cuda")

    def new_job(self, group_layers: list[list[int]], objects_per_group: int, req_ids: list[str]) -> CudaLoadJob:
        return CudaLoadJob(self.side, group_layers, objects_per_group, req_ids)

    def decode(self, blob: bytes, header: ChunkHeader, spans: list[Span]) -> Decoded:
        """Stage, copy and decode one object on the side stream; returns once its staging buffer is free."""
        slots = [s for span in spans for s in span.slots]  # every group's, staged and copied at once
        check_slots(slots, self.num_slots)
        on_device = _on_device(header)
        if on_device:
            body = payload_of(blob, header)
        else:
            cpu = decode_payload(blob, header)  # validated; raises on anything it cannot vouch for
            body = cpu.view(-1).view(torch.uint8)
        at_slots = align8(len(body))
        at_flags = at_slots + 8 * len(slots)
        with self.staging.take(at_flags + FLAG_BYTES) as host:
            _copy_into(host[: len(body)], body)
            slots_host = host_slots(host, at_slots, slots)
            flags_host = host[at_flags:].view(torch.int32)
            with self.side.active():
                dev_slots = torch.empty(len(slots), dtype=torch.int64, device=self.device)
                dev_slots.copy_(slots_host, non_blocking=True)
                if on_device:
                    n = int(np.prod(header.shape, dtype=np.int64))
                    payload = sz.device_payload_buffer(len(body), n, self.device)
                    payload.copy_(host[: len(body)], non_blocking=True)
                    flat, flags = sz.decode_splitzip_gpu_async(payload, n)
                    flags_host.copy_(flags, non_blocking=True)
                    kv = flat.view(header.shape)
                else:
                    raw = torch.empty(len(body), dtype=torch.uint8, device=self.device)
                    raw.copy_(host[: len(body)], non_blocking=True)
                    kv = raw.view(cpu.dtype).view(header.shape)
                    flags_host.zero_()
                copied = self.side.record()
            self.side.host_wait(copied)  # this I/O thread only: staging reusable, flags readable
            sz.raise_if_invalid(flags_host)
        per_group = list(dev_slots.split([len(span.slots) for span in spans]))
        return Decoded(kv, list(spans), on_device, per_group)

    def scatter(self, layers: range, decoded: Decoded) -> None:
        groups = {self.cache_groups[layer] for layer in layers}
        with self.side.active():
            if isinstance(self.objects, PageObjects):  # whole pages: block copies on the device
                self.write_layers(layers, decoded)
                return
            if self.pages is not None and len(groups) == 1:
                kv, slots = _part(decoded, slice(None), groups.pop())
                self.pages.scatter(layers.start, kv, slots)
                return
            for i, layer in enumerate(layers):
                kv, slots = _part(decoded, i, self.cache_groups[layer])
                self.layouts[layer].scatter(self.caches[layer], slots, kv, check=False)


def _part(decoded: Decoded, i: int | slice, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i`` (or the layers of a slice) of the object: its group's tokens and their slots on the device."""
    assert decoded.device_slots is not None, "decoded by CudaPlacement"
    first, slots = decoded.spans[group].first_token, decoded.device_slots[group]
    return decoded.kv[i, :, first : first + slots.numel()], slots


class CudaFetcher(Fetcher):
    """The load path with :class:`CudaPlacement`: everything else is the host fetcher's."""

    def __init__(self, store: Store, addresses: ObjectAddresses, caches: list[torch.Tensor],
                 layouts: list[PagedLayout], threads: int, *args: Any, **kwargs: Any) -> None:
        placement = CudaPlacement(caches, layouts, threads, kwargs.pop("cache_groups", None))
        super().__init__(store, addresses, caches, layouts, threads, *args, placement=placement, **kwargs)
        self.side, self.pages = placement.side, placement.pages


def _on_device(header: ChunkHeader) -> bool:
    """bf16 SplitZip decodes on the device; every other codec on the CPU (then one H2D copy of the raw KV)."""
    return header.dtype is DType.BFLOAT16 and header.codec_config == {"id": "splitzip"}


def _copy_into(dst: torch.Tensor, src: memoryview | torch.Tensor) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: it is only read
        dst.copy_(torch.frombuffer(src, dtype=torch.uint8))


__all__ = ["CudaFetcher", "CudaLoadJob", "CudaPlacement"]
