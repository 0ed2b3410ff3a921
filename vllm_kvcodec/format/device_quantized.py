"""A lossy ``quantized`` chunk decoded on the device: what reads it for :mod:`vllm_kvcodec.gpu.dequant_triton`.

LOSSY: NOT BIT-EXACT against the KV that was saved; its dequantisation is exact (the device writes the reference's
bits, :mod:`~vllm_kvcodec.codecs.quantized`).

* :func:`unpack_quantized`: a chunk's parts read and checked on the host (the integers' rANS planes decoded, every
  size, every minimum finite, every step finite and positive, every integer in range), before anything is staged
  or written. rANS stays on the host: an order-0 decode is a serial state machine per plane, and the integers are
  half (int8) to a quarter (int4) of the bf16 bytes, so the copy is smaller than the lossless one.
* :class:`StagedQuantized`: where those parts lie in one staging buffer, each section 16-byte aligned (the kernel
  then loads whole vectors and compiles once), so one host-to-device copy moves them; :meth:`~StagedQuantized.on_device`
  views the copied buffer as the kernel's :class:`~vllm_kvcodec.gpu.dequant_triton.QuantizedKV`.

No 8-bit video variant is stored: HEVC codes the integers in more bits than rANS on our KV (docs/codec-video.md,
"Lossy integers"). What NVDEC would do with one is measured by the device check
(:mod:`vllm_kvcodec.tools.gpu_integer_video`), not part of the load path.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.codecs.quantized import QuantizedCodec, Unpacked
from vllm_kvcodec.errors import CodecError
from vllm_kvcodec.format.container import ChunkHeader, codec_for, payload_of
from vllm_kvcodec.gpu.dequant_triton import QuantizedKV
from vllm_kvcodec.gpu.staging import align

#: Every section of the staging layout starts at a multiple of this many bytes.
SECTION_ALIGN = 16
_BITS = {2: torch.int16, 4: torch.int32}


def is_quantized(header: ChunkHeader) -> bool:
    return header.codec_config.get("id") == QuantizedCodec.codec_id


def unpack_quantized(blob: bytes | bytearray | memoryview, header: ChunkHeader) -> tuple[QuantizedCodec, Unpacked]:
    """The chunk's codec and its parts, every one checked (:meth:`QuantizedCodec.unpack`); raises on anything bad."""
    codec = codec_for(header)
    if not isinstance(codec, QuantizedCodec):
        raise CodecError(f"codec {header.codec_id!r} is not the quantized codec")
    return codec, codec.unpack(payload_of(blob, header), header.dtype, header.shape)


@dataclasses.dataclass(frozen=True)
class StagedQuantized:
    """A quantized object's parts, laid out for one copy: integers (unless they come from NVDEC), scales, kept bits.

    Made by :meth:`of` from what :func:`unpack_quantized` read; :meth:`write` fills a host buffer, and
    :meth:`on_device` views the buffer once it is where the kernel runs."""

    parts: Unpacked
    codec: QuantizedCodec
    dtype: DType
    shape: tuple[int, ...]
    offsets: tuple[int, ...]  # of each of _arrays(), in order
    nbytes: int
    with_integers: bool = True

    @classmethod
    def of(cls, codec: QuantizedCodec, parts: Unpacked, header: ChunkHeader,
           with_integers: bool = True) -> StagedQuantized:
        offsets, at = [], 0
        for array in _arrays(parts, with_integers):
            offsets.append(at)
            at = align(at + array.nbytes, SECTION_ALIGN)
        return cls(parts, codec, header.dtype, tuple(header.shape), tuple(offsets), at, with_integers)

    def write(self, host: torch.Tensor) -> None:
        """Copy every section into ``host`` (a uint8 tensor of at least :attr:`nbytes`)."""
        for array, at in zip(_arrays(self.parts, self.with_integers), self.offsets):
            if array.nbytes:
                host[at : at + array.nbytes].copy_(torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))

    def on_device(self, buffer: torch.Tensor, integers: torch.Tensor | None = None) -> QuantizedKV:
        """The kernel's view of ``buffer`` (the staged bytes, copied to the device at a 16-byte aligned address);
        ``integers``: the keys and values ``[2, Lq, Tq, heads, dim]`` uint8 already there (NVDEC's), when not staged."""
        layers, _, tokens, heads, dim = self.shape
        lq, tq = layers - self.codec.full_layers, tokens - self.codec.sink_tokens
        views = [_view(buffer, at, array) for array, at in zip(_arrays(self.parts, self.with_integers), self.offsets)]
        if not self.with_integers:
            if integers is None or tuple(integers.shape) != (2, lq, tq, heads, dim):
                raise CodecError(f"the integers of a [{layers}, 2, {tokens}, {heads}, {dim}] object are [2, {lq}, {tq}, "
                                 f"{heads}, {dim}], not {None if integers is None else tuple(integers.shape)}")
            views = [integers[0], integers[1], *views]
        keys, values, k_min, k_step, v_min, v_step, kept = views
        return QuantizedKV(keys.view(lq, tq, heads, dim), values.view(lq, tq, heads, dim), k_min.view(lq, heads, dim),
                           k_step.view(lq, heads, dim), v_min.view(lq, tq, heads), v_step.view(lq, tq, heads),
                           kept.view(_BITS[self.dtype.itemsize]), layers, tokens, self.codec.full_layers,
                           self.codec.sink_tokens, self.dtype.torch_dtype)


def _arrays(parts: Unpacked, with_integers: bool) -> list[np.ndarray]:
    scales = [parts.k_min, parts.k_step, parts.v_min, parts.v_step]
    kept = parts.kept.astype(parts.kept.dtype.newbyteorder("<"), copy=False)  # the device's bytes
    return [*([parts.keys, parts.values] if with_integers else []), *scales, kept]


def _view(buffer: torch.Tensor, at: int, array: np.ndarray) -> torch.Tensor:
    """``array``'s section of ``buffer``, as a flat tensor of its dtype (uint8, float32, or the kept bits' width)."""
    section = buffer[at : at + array.nbytes]
    if array.dtype == np.uint8:
        return section
    if array.dtype == np.float32:
        return section.view(torch.float32)
    return section.view(_BITS[array.dtype.itemsize])


__all__ = ["SECTION_ALIGN", "StagedQuantized", "is_quantized", "unpack_quantized"]
