"""NVDEC on a lossy chunk's integers, measured: the device side of an 8-bit video variant that is not stored.

KVCodec codes its 8-bit integers as HEVC pictures and decodes them with NVDEC. On our KV the integers do not
compress that way (``kvcodec bench layouts``: HEVC in the paper's layout 9.75 bits per int8 value, rANS 7.72; see
docs/codec-video.md), so the quantized codec stores rANS planes and the load path never decodes video integers.
What NVDEC would give such a variant (pictures per second, decode offload) is still worth a number on a GPU: the
device check's ``lossy_nvdec`` section (benchmarks/gpu_check_lossy.py) codes the integers as HEVC 4:4:4 8-bit
pictures (NVDEC's native input; keys then values, one token's channels of one layer per picture row: the ``video``
codec's layout 1 over ``[2, Lq, Tq, heads, dim]``), decodes them with an NVDEC session on the device, checks them
there (a digest of their bytes and their range) and dequantises them into the pages.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_kvcodec.codecs.quantized import QuantizedCodec, Unpacked
from vllm_kvcodec.codecs.video_layout import FrameGeometry, geometry, to_planes
from vllm_kvcodec.errors import CodecError
from vllm_kvcodec.format.container import ValueDigest
from vllm_kvcodec.format.device_chunks import SegmentedDigestCheck, ValueCheck
from vllm_kvcodec.gpu import nvcodec


def integer_shape(shape: tuple[int, ...], codec: QuantizedCodec) -> tuple[int, int, int, int, int]:
    """``[2, Lq, Tq, heads, dim]``: an object's keys then values (an object of ``shape``)."""
    layers, _, tokens, heads, dim = shape
    return 2, layers - codec.full_layers, tokens - codec.sink_tokens, heads, dim


def integer_geometry(shape: tuple[int, ...], codec: QuantizedCodec) -> FrameGeometry:
    """The pictures an object's integers fill: the ``video`` codec's layout 1 over :func:`integer_shape` (a row is
    one token's ``heads * dim`` channels of one layer's K or V; a column one channel)."""
    return geometry(integer_shape(shape, codec))


def integer_planes(parts: Unpacked, geo: FrameGeometry) -> np.ndarray:
    """The ``[frames, 3, height, width]`` uint8 pictures of ``parts``' integers (what an HEVC encoder codes)."""
    return to_planes(np.concatenate([parts.keys.reshape(-1), parts.values.reshape(-1)]), geo)


def decode_integer_planes(packets: list[memoryview], shape: tuple[int, ...], session: Any,
                          device: torch.device) -> torch.Tensor:
    """The integers ``shape`` (:func:`integer_shape`) of one picture per packet, decoded by ``session`` (an NVDEC
    session: :class:`~vllm_kvcodec.gpu.nvdec_sessions.NvdecSession`) on ``device``, cropped from the pictures.

    Not yet checked: :class:`IntegerCheck` before anything is scattered. Enqueued on the current stream.
    """
    geo = geometry(tuple(shape))
    if len(packets) != geo.frames:
        raise CodecError(f"{len(packets)} packets for the {geo.frames} pictures of {tuple(shape)} integers")
    planes = torch.empty((geo.frames, nvcodec.PLANES, geo.height, geo.width), dtype=torch.uint8, device=device)
    session.decode_into(packets, geo.width, geo.height, planes)
    return nvcodec.planes_to_exponents(planes, geo).reshape(shape)  # the layout's crop: bytes, whatever they hold


class IntegerCheck(ValueCheck):
    """Integers a video decoder gave, checked on the device before any scatter: the segmented XXH3-64 of their bytes
    (the chunk format's value digest, :func:`vllm_kvcodec.format.value_digest`) and their largest value."""

    kind = "integer digest (segmented XXH3-64) and range"

    def __init__(self, digest: ValueDigest, n: int, levels: int) -> None:
        self.digest, self.levels = SegmentedDigestCheck(digest, n), levels
        self.readback_bytes = self.digest.readback_bytes + 1

    def launch(self, values: torch.Tensor, readback: torch.Tensor) -> None:
        at = self.digest.readback_bytes
        self.digest.launch(values, readback[:at])
        readback[at:].copy_(values.reshape(-1).amax().reshape(1))

    def verify(self, readback: bytes | memoryview) -> None:
        view = memoryview(readback).cast("B")
        self.digest.verify(view[: self.digest.readback_bytes])
        if view[self.digest.readback_bytes] > self.levels:
            raise CodecError(f"decoded integers exceed {self.levels}")
