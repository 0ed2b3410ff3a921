"""The load path's placement on a GPU: pinned staging -> H2D, decode, scatter on a side stream.

The :class:`~vllm_kvcodec.load.fetcher.Fetcher` fetches and validates each
object on its I/O threads as for host memory; this placement supplies the rest:

1. Into a pinned staging buffer (:class:`~vllm_kvcodec.gpu.staging.StagingPool`,
   one per thread): the bf16 ``splitzip`` payload as is; for a bf16 ``video``
   (HEVC) object its sign+mantissa bytes (the stream goes to NVDEC); for a lossy
   ``quantized`` object (LOSSY: NOT BIT-EXACT) its integers, rANS-decoded and
   checked on the host, its scales and kept values, in one copy; for every
   other codec, the tensor the CPU codec decodes; plus the slots (the
   scheduler's list, checked on the host against its group's cache: no device sync).
2. On the side stream: H2D copies, then the Triton SplitZip decode (device-
   side validation flags copied back into the staging buffer), then an event
   the *I/O thread* waits on: the staging buffer is free again and the flags
   are read. A payload that fails its checks is never scattered.
   A ``video`` object: an NVDEC session for its picture size from a pool
   (:mod:`~vllm_kvcodec.gpu.nvdec_sessions`, reused, as many as the GPU has
   NVDEC engines) decodes its stream into device pictures; on the side stream
   the Triton join makes the bf16 values. Values decoded on the device are
   checked there (:func:`vllm_kvcodec.format.device_chunks.value_check`): the chunk's
   value digest (one XXH3 per segment, all at once; SplitZip chunks that carry
   one too), else an older video chunk's exponent hash; what it reads back
   lands beside the slots and the I/O thread finishes and compares it. Where
   NVDEC is missing (no PyNvVideoCodec, no driver library, no decoder, or it
   reports the stream unsupported) the CPU codec decodes (logged once).
3. On the side stream: the Triton scatter of the whole layer group
   (:class:`~vllm_kvcodec.gpu.scatter_triton.PackedPages`, one launch; for a
   lossy object :func:`~vllm_kvcodec.gpu.dequant_triton.dequantize_into_pages`,
   which dequantises as it scatters, bit-exact with the CPU decoder) or, for
   layouts it does not cover and for layers of several vLLM KV cache groups
   (each with its own slots), each layer's page layout (torch indexing, on the device).
4. When the last object of a layer group is enqueued, one CUDA event is
   recorded for the group (:class:`CudaLoadJob`); ``wait_layer`` waits on the
   host only until that event *exists*, then makes the engine's current stream
   wait on it on the device: the engine's thread never synchronises with the GPU.

Triton compiles a kernel on its first launch of each specialisation: the
fetcher's threads would compile the same one at once, so :meth:`CudaPlacement.warm`
launches them on the constructing thread first (on a CUDA device).

Before a load's first object is enqueued, the side stream waits on the device
for the save path's reads of the blocks it writes (:mod:`~vllm_kvcodec.gpu.block_reads`):
vLLM may hand a load the blocks of a request whose tail was gathered, on the
save path's own stream, a step before.

Cancellation (the deadline passed) forbids new scatters as on the host, then
makes the engine's stream wait for those already enqueued, so none can land
after vLLM starts recomputing those blocks.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from storage import Store
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.codecs.video_layout import geometry as video_geometry
from vllm_kvcodec.format.device_chunks import is_nvdec_video, parse_video_payload, value_check
from vllm_kvcodec.format.device_quantized import SECTION_ALIGN, StagedQuantized, is_quantized, unpack_quantized
from vllm_kvcodec.format import ChunkHeader, decode_payload, payload_of
from vllm_kvcodec.gpu import nvcodec
from vllm_kvcodec.gpu.block_reads import layout_blocks
from vllm_kvcodec.gpu.dequant_triton import QuantizedKV, dequantize_into_pages
from vllm_kvcodec.gpu.launch import can_run_on, interpreted
from vllm_kvcodec.gpu.nvdec_join_triton import READBACK_BYTES, exponent_digest_into, join_exponents
from vllm_kvcodec.gpu.nvdec_sessions import NvdecDecoders, PlanesSession, SessionPool
from vllm_kvcodec.gpu.scatter_triton import check_slots, packed_pages_for
from vllm_kvcodec.gpu.side_stream import SideStream
from vllm_kvcodec.gpu.staging import StagingPool, align, align8, host_slots
from vllm_kvcodec.keys.chain import ObjectAddresses
from vllm_kvcodec.gpu import splitzip_triton as sz
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.load.placement import Decoded, Placement
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.paged import PagedLayout
from vllm_kvcodec.paged.objects import PageObjects
from vllm_kvcodec.plans.spans import Span

if TYPE_CHECKING:  # imports vLLM; the load path itself must not (the GPU check runs without it)
    from vllm_kvcodec.plans.loads import ChunkLoad

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
                 cache_groups: list[int] | None = None,
                 video_sessions: Callable[[torch.device], PlanesSession] | None = None) -> None:
        """``video_sessions``: makes the decoder sessions for ``video`` objects (default: NVDEC where it works here)."""
        super().__init__(caches, layouts, cache_groups)
        self.device = caches[0].device
        if not can_run_on(self.device):
            raise ConfigError(f"the GPU load path cannot run Triton kernels on {self.device} in this process")
        self.side = SideStream(self.device)
        self.pages = packed_pages_for(caches, layouts)
        self.group_slots = _slots_per_group(caches, layouts, self.cache_groups)
        self.group_block_size = {group: layout.block_size for layout, group in zip(layouts, self.cache_groups)}
        self.staging = StagingPool(threads, pin=self.device.type == "cuda")
        self.nvdec = NvdecDecoders(self.device, threads, video_sessions)

    def new_job(self, group_layers: list[list[int]], objects_per_group: int, req_ids: list[str]) -> CudaLoadJob:
        return CudaLoadJob(self.side, group_layers, objects_per_group, req_ids)

    def decode(self, blob: bytes, header: ChunkHeader, spans: list[Span]) -> Decoded:
        """Stage, copy and decode one object on the side stream; returns once its staging buffer is free."""
        slots = self._checked_slots(spans)
        if self._dequantizes(header, spans):
            return self._decode_quantized(blob, header, spans, slots)
        if is_nvdec_video(header) and (pool := self.nvdec.pool()) is not None:
            try:
                return self._decode_video(blob, header, spans, slots, pool)
            except nvcodec.NvCodecUnavailable as exc:  # no decoder can be made here: the CPU, from now on
                self.nvdec.disable(str(exc))
        on_device = _on_device(header)
        if on_device:
            body = payload_of(blob, header)
        else:
            cpu = decode_payload(blob, header)  # validated; raises on anything it cannot vouch for
            body = cpu.view(-1).view(torch.uint8)
        check = value_check(header) if on_device else None  # the CPU decode checked its own
        at_slots = align8(len(body))
        at_flags = at_slots + 8 * len(slots)
        at_back = at_flags + FLAG_BYTES
        with self.staging.take(at_back + (check.readback_bytes if check else 0)) as host:
            _copy_into(host[: len(body)], body)
            slots_host = host_slots(host, at_slots, slots)
            flags_host = host[at_flags:at_back].view(torch.int32)
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
                    if check is not None:
                        back = torch.empty(check.readback_bytes, dtype=torch.uint8, device=self.device)
                        check.launch(flat, back)
                        host[at_back:].copy_(back, non_blocking=True)
                else:
                    raw = torch.empty(len(body), dtype=torch.uint8, device=self.device)
                    raw.copy_(host[: len(body)], non_blocking=True)
                    kv = raw.view(cpu.dtype).view(header.shape)
                    flags_host.zero_()
                copied = self.side.record()
            self.side.host_wait(copied)  # this I/O thread only: staging reusable, flags readable
            sz.raise_if_invalid(flags_host)
            if check is not None:
                check.verify(host[at_back:].numpy().tobytes())
        return Decoded(kv, list(spans), on_device, _per_group(dev_slots, spans))

    def _dequantizes(self, header: ChunkHeader, spans: list[Span]) -> bool:
        """A lossy ``quantized`` object the kernel dequantises into the pages: packed K‖V caches of one KV cache group,
        canonical objects (every lossy namespace is, whatever the engine's own: connector/precisions.py), no value
        digest (the CPU decode checks one; the kernel keeps no values to hash)."""
        return (is_quantized(header) and self.pages is not None and len(spans) == 1 and header.value_digest is None
                and sys.byteorder == "little")

    def _decode_quantized(self, blob: bytes, header: ChunkHeader, spans: list[Span], slots: list[int]) -> Decoded:
        """rANS and every check on the host; the integers, scales, kept values and slots staged and copied at once."""
        codec, parts = unpack_quantized(blob, header)  # raises on anything bad: nothing staged, nothing written
        staged = StagedQuantized.of(codec, parts, header)
        at_slots = align(staged.nbytes, SECTION_ALIGN)
        with self.staging.take(at_slots + 8 * len(slots)) as host:
            staged.write(host)
            host_slots(host, at_slots, slots)
            with self.side.active():
                dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
                dev.copy_(host, non_blocking=True)
                copied = self.side.record()
            self.side.host_wait(copied)  # this I/O thread only: staging reusable
        return Decoded(staged.on_device(dev), list(spans), True, [dev[at_slots:].view(torch.int64)])

    def order_after_reads(self, chunks: list[ChunkLoad]) -> None:
        """The side stream waits (on the device) for the save gathers that read any block these chunks write."""
        if self.block_reads is None:
            return
        blocks: set[int] = set()
        for chunk in chunks:
            for group, span in enumerate(chunk.spans):
                if span.slots:
                    blocks |= layout_blocks(span.slots, self.group_block_size[group])
        self.side.side_waits_for(self.block_reads.pending(blocks))

    def _checked_slots(self, spans: list[Span]) -> list[int]:
        """Every group's slots in one list (staged and copied at once), each checked against its own group's cache."""
        for group, span in enumerate(spans):
            check_slots(span.slots, self.group_slots.get(group, 0) if span.slots else 0)
        return [s for span in spans for s in span.slots]

    def _decode_video(self, blob: bytes, header: ChunkHeader, spans: list[Span], slots: list[int],
                      pool: SessionPool) -> Decoded:
        """A bf16 ``video``/``hevc`` object: NVDEC -> device pictures, joined and checked on the device."""
        parsed = parse_video_payload(payload_of(blob, header), header.shape)  # sizes, before anything is allocated
        geo = parsed.geometry
        check = value_check(header, parsed)
        at_slots = align8(geo.n)
        at_back = at_slots + 8 * len(slots)
        with self.staging.take(at_back + check.readback_bytes) as host, pool.take((geo.width, geo.height)) as session:
            _copy_into(host[: geo.n], parsed.signman)
            slots_host = host_slots(host, at_slots, slots)
            back_host = host[at_back:]
            with self.side.active():
                planes = torch.empty((geo.frames, nvcodec.PLANES, geo.height, geo.width), dtype=torch.uint8,
                                     device=self.device)
                session.decode_into(parsed.packets(), geo.width, geo.height, planes)
                dev_slots = torch.empty(len(slots), dtype=torch.int64, device=self.device)
                dev_slots.copy_(slots_host, non_blocking=True)
                signman = torch.empty(geo.n, dtype=torch.uint8, device=self.device)
                signman.copy_(host[: geo.n], non_blocking=True)
                values = torch.empty(geo.n, dtype=torch.int16, device=self.device)
                join_exponents(planes, signman, geo, values)
                back = torch.empty(check.readback_bytes, dtype=torch.uint8, device=self.device)
                check.launch(values, back)
                back_host.copy_(back, non_blocking=True)
                copied = self.side.record()
            self.side.host_wait(copied)  # this I/O thread only; the session's surfaces are free again too
            check.verify(back_host.numpy().tobytes())
        kv = values.view(torch.bfloat16).view(header.shape)
        return Decoded(kv, list(spans), True, _per_group(dev_slots, spans))

    def warm(self, object_shape: tuple[int, ...], tokens: int) -> None:
        """Compile the kernels one object of ``object_shape`` launches, on this thread, before the fetch threads do.

        Runs the SplitZip decode (bf16), the join and checksum kernels, and a
        gather then scatter of the same bits (a full chunk and a partial one)
        on the side stream; the caches keep their contents. A no-op in the
        interpreter (nothing is compiled there).
        """
        if interpreted() and self.device.type == "cpu":
            return
        self._warm(object_shape, tokens)

    def _warm(self, object_shape: tuple[int, ...], tokens: int) -> None:
        n = int(np.prod(object_shape, dtype=np.int64))
        dtype = self.caches[0].dtype
        with self.side.active():
            if dtype == torch.bfloat16 and n:
                for escapes in _WARM_ESCAPES:  # Triton specialises int arguments on == 1 and % 16: each case once
                    if n >= 32 * (escapes + 1):
                        x = _with_escapes(n, escapes, self.device)
                        payload = sz.encode_splitzip_gpu(x)
                        buf = sz.device_payload_buffer(payload.numel(), n, self.device)
                        buf.copy_(payload)
                        sz.raise_if_invalid(sz.decode_splitzip_gpu_async(buf, n)[1])
                geo = video_geometry(tuple(object_shape))
                planes = torch.zeros((geo.frames, nvcodec.PLANES, geo.height, geo.width), dtype=torch.uint8,
                                     device=self.device)
                values = torch.empty(geo.n, dtype=torch.int16, device=self.device)
                join_exponents(planes, torch.zeros(geo.n, dtype=torch.uint8, device=self.device), geo, values)
                exponent_digest_into(values, torch.empty(READBACK_BYTES, dtype=torch.uint8, device=self.device))
                _warm_value_digest(values)
            if self.pages is not None and len(object_shape) == 5 and tokens <= self.pages.num_slots:
                self._warm_pages(object_shape, tokens)
        if self.side.stream is not None:
            self.side.stream.synchronize()  # start-up, not the engine's stream

    def _warm_pages(self, object_shape: tuple[int, ...], tokens: int) -> None:
        """Gather then scatter back the same slots (contents unchanged), for a whole chunk and a partial one; the
        dequantising scatter the same way."""
        layers = object_shape[0]
        if layers > len(self.caches):
            return
        whole = torch.empty(object_shape, dtype=self.caches[0].dtype, device=self.device)
        starts = {0, layers} if 2 * layers <= len(self.caches) else {0}  # the pointer table's offset: 16-aligned or not
        for layer in sorted(starts):
            for first in (0, 1):
                count = min(tokens, object_shape[2]) - first
                if count < 1:
                    continue
                slots = torch.arange(count, dtype=torch.int64, device=self.device)
                part = whole[:, :, first : first + count]
                self.pages.gather(layer, slots, part)
                self.pages.scatter(layer, part, slots)
                _warm_dequantize(self.pages, layer, whole, first, slots)

    def shutdown(self) -> None:
        self.nvdec.close()

    def scatter(self, layers: range, decoded: Decoded) -> None:
        groups = {self.cache_groups[layer] for layer in layers}
        with self.side.active():
            if isinstance(decoded.kv, QuantizedKV):  # one group, packed pages (_dequantizes)
                dequantize_into_pages(self.pages, layers.start, decoded.kv, decoded.spans[0].first_token,
                                      decoded.device_slots[0])
                return
            if isinstance(self.objects_of(decoded), PageObjects):  # whole pages: block copies on the device
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
        placement = CudaPlacement(caches, layouts, threads, kwargs.pop("cache_groups", None),
                                  video_sessions=kwargs.pop("video_sessions", None))
        super().__init__(store, addresses, caches, layouts, threads, *args, placement=placement, **kwargs)
        self.side, self.pages = placement.side, placement.pages
        ns = addresses.namespace
        first = self.groups[0][0]
        shape = self.objects.object_shape(len(self.groups[0]), layouts[first], caches[first], ns.chunk_size)
        placement.warm(tuple(shape), ns.chunk_size)


_WARM_ESCAPES = (0, 1, 16, 17)


def _with_escapes(n: int, escapes: int, device: torch.device) -> torch.Tensor:
    """``n`` bf16 values over 16 common exponents, plus exactly ``escapes`` values of a rare one."""
    x = torch.tensor([2.0**i for i in range(16)], dtype=torch.bfloat16).repeat(n // 16 + 1)[:n]
    if escapes:
        x[torch.linspace(0, n - 1, escapes).long()] = 2.0**-100
    return x.to(device)


def _per_group(dev_slots: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
    return list(dev_slots.split([len(span.slots) for span in spans]))


def _slots_per_group(caches: list[torch.Tensor], layouts: list[PagedLayout], cache_groups: list[int]) -> dict[int, int]:
    """Slots a group's spans may address: the fewest any of its layers holds (a sliding-window group can have its
    own block size and count, so layer 0's figure is not every group's)."""
    slots: dict[int, int] = {}
    for cache, layout, group in zip(caches, layouts, cache_groups):
        n = layout.num_slots(cache)
        slots[group] = min(slots.get(group, n), n)
    return slots


def _warm_dequantize(pages: Any, layer: int, whole: torch.Tensor, first: int, slots: torch.Tensor) -> None:
    """Compile the dequantising scatter: an object whose every layer is kept at full precision, holding the bits just
    gathered, so it writes them back unchanged (its integer arguments are not specialised on: one kernel for all)."""
    if whole.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return
    layers, _, tokens, heads, dim = whole.shape
    bits = whole.contiguous().view(torch.int32 if whole.element_size() == 4 else torch.int16).reshape(-1)
    none = torch.empty((0, tokens, heads, dim), dtype=torch.uint8, device=whole.device)
    scales = torch.empty((0, heads, dim), dtype=torch.float32, device=whole.device)
    per_token = torch.empty((0, tokens, heads), dtype=torch.float32, device=whole.device)
    q = QuantizedKV(none, none, scales, scales, per_token, per_token, bits, layers, tokens, layers, 0, whole.dtype)
    dequantize_into_pages(pages, layer, q, first, slots)


def _warm_value_digest(values: torch.Tensor) -> None:
    """Compile the value digest kernel for the video codec's segment size (the one chunks carry by default)."""
    from vllm_kvcodec.codecs.video import VideoCodec
    from vllm_kvcodec.gpu import value_digest_triton as vd

    data = values.view(torch.uint8)
    back = torch.empty(vd.readback_bytes(data.numel(), VideoCodec.value_digest_segment), dtype=torch.uint8,
                       device=values.device)
    vd.value_digest_into(data, VideoCodec.value_digest_segment, back)


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
