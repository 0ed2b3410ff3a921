"""Chunks decoded on a device: what reads the chunk format (and the ``video`` payload) for :mod:`vllm_kvcodec.gpu`.

``vllm_kvcodec.gpu`` holds device plumbing only (kernels, NVDEC/NVENC
sessions, streams, staging) and imports neither the chunk format nor a codec;
:mod:`vllm_kvcodec.codecs.video` imports ``gpu.nvcodec`` for NVENC. This
module sits above both, so the package has no import circle:

* the ``video`` payload parsed and size-checked against its chunk shape
  (:func:`parse_video_payload`), and a bf16 ``video``/``hevc`` chunk decoded
  with NVDEC (:func:`decode_video_chunk_nvdec`);
* SplitZip chunks made and read with the Triton kernels (:class:`SplitZipGPU`);
* what vouches for values decoded on the device (:func:`value_check`): the
  chunk's value digest where it carries one (segmented XXH3, one device
  program per segment), else for an older ``video`` chunk its payload's
  whole-input XXH3-64 of the exponents.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vllm_kvcodec import format as fmt
from vllm_kvcodec.codecs.video_layout import FrameGeometry, geometry
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import CodecError, ConfigError
from vllm_kvcodec.format import ChunkHeader
from vllm_kvcodec.gpu import nvcodec, nvdec_sessions

#: Layout of the video payload header (``codecs.video._HEAD``; the tests check they agree).
VIDEO_HEAD = struct.Struct("<HHIQ")  # width, height, frames, xxh3-64 of the exponent bytes


# --------------------------------------------------------------------------------------
# The video payload
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VideoPayload:
    """A bfloat16 ``video`` payload, split and size-checked against its chunk shape."""

    width: int
    height: int
    frames: int
    exp_hash: int
    signman: memoryview  # n bytes
    packet_sizes: tuple[int, ...]
    stream: memoryview  # the HEVC Annex B elementary stream (for backend "hevc")
    geometry: FrameGeometry

    def packets(self) -> list[memoryview]:
        return nvcodec.split_packets(self.stream, self.packet_sizes)


def parse_video_payload(payload: bytes | memoryview, shape: tuple[int, ...]) -> VideoPayload:
    """Check a bfloat16 ``video`` payload against ``shape`` (as the CPU decoder does) and split it."""
    geo = geometry(tuple(int(d) for d in shape))
    buf = memoryview(payload).cast("B")
    if len(buf) < VIDEO_HEAD.size:
        raise CodecError("video payload is shorter than its header")
    width, height, frames, exp_hash = VIDEO_HEAD.unpack_from(buf)
    if (width, height, frames) != (geo.width, geo.height, geo.frames):
        raise CodecError(
            f"video payload promises {frames} pictures of {width}x{height}; "
            f"shape {tuple(shape)} needs {geo.frames} of {geo.width}x{geo.height}"
        )
    at = VIDEO_HEAD.size
    if len(buf) < at + geo.n + 4 * frames:
        raise CodecError("video payload is truncated before its packet table")
    signman = buf[at : at + geo.n]
    at += geo.n
    sizes = np.frombuffer(buf[at : at + 4 * frames], dtype="<u4").astype(np.int64)
    at += 4 * frames
    stream = buf[at:]
    if sizes.min() < 1 or int(sizes.sum()) != len(stream):
        raise CodecError(f"video packet sizes (sum {int(sizes.sum())}) do not match the {len(stream)} stream bytes")
    return VideoPayload(width, height, frames, exp_hash, signman, tuple(int(s) for s in sizes), stream, geo)


def is_nvdec_video(header: ChunkHeader) -> bool:
    """A bf16 HEVC ``video`` chunk, which NVDEC can decode (h264 4:4:4 and ffv1 it cannot)."""
    config = header.codec_config
    return (header.dtype is DType.BFLOAT16 and config.get("id") == "video" and config.get("backend") == "hevc"
            and config.get("layout") == 1)


def decode_video_payload_nvdec(
    payload: bytes | memoryview,
    shape: tuple[int, ...],
    device: torch.device | str = "cuda",
    *,
    verify_hash: bool = True,
    planes_decoder: Callable[[bytes, int, int, int, torch.device], torch.Tensor] | None = None,
    session: Any | None = None,
) -> torch.Tensor:
    """Decode a bfloat16 ``video``/``hevc`` *payload* of ``shape`` on the GPU (NVDEC + torch ops).

    ``verify_hash`` checks the payload's XXH3-64 of the exponent bytes (one
    device-to-host copy of ``n`` bytes), as the CPU decoder does.
    ``planes_decoder`` replaces NVDEC; ``session`` is a decoder session or a
    :class:`~vllm_kvcodec.gpu.nvdec_sessions.SessionPool` (see
    :func:`~vllm_kvcodec.gpu.nvdec_sessions.nvdec_decode_planes`). The load path does
    not come here: :mod:`vllm_kvcodec.load.cuda_placement` joins and checks on the device.
    """
    device = torch.device(device)
    parsed = parse_video_payload(payload, shape)
    if planes_decoder is not None:
        planes = planes_decoder(bytes(parsed.stream), parsed.width, parsed.height, parsed.frames, device)
    else:
        planes = nvdec_sessions.nvdec_decode_planes(parsed.stream, parsed.width, parsed.height, parsed.frames, device,
                                             packet_sizes=parsed.packet_sizes, session=session)
    exps = nvcodec.planes_to_exponents(planes, parsed.geometry)
    if verify_hash:
        import xxhash

        if xxhash.xxh3_64_intdigest(exps.cpu().numpy().tobytes()) != parsed.exp_hash:
            raise CodecError("video hevc stream decoded to exponents that fail their checksum")
    signman = torch.frombuffer(bytearray(parsed.signman), dtype=torch.uint8).to(device)
    return nvcodec.join_bf16(exps, signman).reshape(tuple(shape))


def decode_video_chunk_nvdec(
    blob: bytes | bytearray | memoryview,
    device: torch.device | str = "cuda",
    *,
    verify_hash: bool = True,
    planes_decoder: Callable[[bytes, int, int, int, torch.device], torch.Tensor] | None = None,
    session: Any | None = None,
) -> torch.Tensor:
    """Decode a bfloat16 ``video``/``hevc`` chunk blob on the GPU: :func:`decode_video_payload_nvdec` after
    :func:`vllm_kvcodec.format.read_header` (header and trailer), then its value digest where it has one."""
    header = fmt.read_header(blob)
    if not is_nvdec_video(header):
        raise ConfigError(f"NVDEC decodes bfloat16 'video' chunks with backend 'hevc', not {header.codec_config} "
                          f"{header.dtype.name}")
    kv = decode_video_payload_nvdec(fmt.payload_of(blob, header), header.shape, device, verify_hash=verify_hash,
                                    planes_decoder=planes_decoder, session=session)
    if verify_hash:
        fmt.verify_value_digest(kv.cpu().view(torch.int16).numpy(), header)
    return kv


# --------------------------------------------------------------------------------------
# What vouches for values decoded on the device
# --------------------------------------------------------------------------------------


class ValueCheck:
    """A device-side check of decoded values: ``launch`` on the current stream, ``verify`` on the host afterwards."""

    readback_bytes: int = 0
    kind: str = "none"

    def launch(self, values: torch.Tensor, readback: torch.Tensor) -> None:
        """Enqueue what the host needs about ``values`` (the decoded elements, contiguous) into ``readback``."""

    def verify(self, readback: bytes | memoryview) -> None:
        """Raise :class:`CodecError` unless the values hashed to what the chunk promises."""


class SegmentedDigestCheck(ValueCheck):
    """The chunk's value digest (flag ``VALUE_DIGEST``): one XXH3 per segment on the device, all at once."""

    kind = "value digest (segmented XXH3-64)"

    def __init__(self, digest: fmt.ValueDigest, nbytes: int) -> None:
        from vllm_kvcodec.gpu import value_digest_triton as vd

        self.digest, self.nbytes, self._vd = digest, nbytes, vd
        self.readback_bytes = vd.readback_bytes(nbytes, digest.segment)

    def launch(self, values: torch.Tensor, readback: torch.Tensor) -> None:
        self._vd.value_digest_into(values.reshape(-1).view(torch.uint8), self.digest.segment, readback)

    def verify(self, readback: bytes | memoryview) -> None:
        if self._vd.finish_value_digest(readback, self.nbytes, self.digest.segment) != self.digest.digest:
            raise CodecError("values decoded on the device fail the chunk's value digest")


class ExponentHashCheck(ValueCheck):
    """An older ``video`` chunk (no value digest): its payload's whole-input XXH3-64 of the exponents (one program)."""

    kind = "exponent XXH3-64 (one program)"

    def __init__(self, exp_hash: int, n: int) -> None:
        from vllm_kvcodec.gpu import nvdec_join_triton as join

        self.exp_hash, self.n, self._join = exp_hash, n, join
        self.readback_bytes = join.READBACK_BYTES

    def launch(self, values: torch.Tensor, readback: torch.Tensor) -> None:
        self._join.exponent_digest_into(values.reshape(-1), readback)

    def verify(self, readback: bytes | memoryview) -> None:
        if self._join.finish_xxh3(readback, self.n) != self.exp_hash:
            raise CodecError("video hevc stream decoded (NVDEC) to exponents that fail their checksum")


def value_check(header: ChunkHeader, video: VideoPayload | None = None) -> ValueCheck | None:
    """The check for values decoded on the device from this chunk: its value digest, else (``video``) the
    payload's exponent hash, else None (a SplitZip chunk without one: the trailer and the device flags suffice)."""
    if header.value_digest is not None:
        return SegmentedDigestCheck(header.value_digest, header.raw_nbytes)
    if video is not None:
        return ExponentHashCheck(video.exp_hash, video.geometry.n)
    return None


# --------------------------------------------------------------------------------------
# SplitZip chunks with the Triton kernels
# --------------------------------------------------------------------------------------


class SplitZipGPU:
    """Chunks with codec ``"splitzip"`` made and read with the Triton kernels.

    :meth:`encode_chunk_gpu` returns the exact blob ``format.encode_chunk(kv,
    "splitzip")`` returns for a bfloat16 tensor (other dtypes fall back to the
    CPU codec). :meth:`decode_chunk_gpu` decodes any chunk onto a device: a
    bfloat16 ``splitzip`` chunk with the kernels (and its value digest, where
    it has one, checked on the device), anything else through the CPU
    ``decode_chunk`` and a copy.
    """

    codec_id = "splitzip"

    def __init__(self, encode_options: dict[str, Any] | None = None,
                 decode_options: dict[str, Any] | None = None) -> None:
        self.encode_options = dict(encode_options or {})
        self.decode_options = dict(decode_options or {})

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        from vllm_kvcodec.gpu import splitzip_triton as sz

        return sz.encode_splitzip_gpu(x.contiguous(), **self.encode_options)

    def decode(self, payload: torch.Tensor | bytes, shape: tuple[int, ...], *,
               device: torch.device | str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        from vllm_kvcodec.gpu import splitzip_triton as sz

        n = int(np.prod(shape, dtype=np.int64))
        flat = None if out is None else out.view(-1)
        return sz.decode_splitzip_gpu(payload, n, flat, device=device, **self.decode_options).view(shape)

    def encode_chunk_gpu(self, kv: torch.Tensor) -> bytes:
        if kv.dtype != torch.bfloat16:
            return fmt.encode_chunk(kv, self.codec_id)
        shape = tuple(int(d) for d in kv.shape)
        return build_splitzip_chunk(self.encode(kv).cpu().numpy(), shape)

    def decode_chunk_gpu(self, blob: bytes | bytearray | memoryview, device: torch.device | str | None = None) -> torch.Tensor:
        from vllm_kvcodec.gpu.launch import can_run_on

        dev = torch.device(device) if device is not None else torch.device("cuda")
        header = fmt.read_header(blob)  # validates sizes and the checksum
        if header.dtype is not DType.BFLOAT16 or header.codec_config != {"id": self.codec_id} or not can_run_on(dev):
            return fmt.decode_chunk(blob).to(dev)
        kv = self.decode(fmt.payload_of(blob, header), header.shape, device=dev)
        if (check := value_check(header)) is not None:
            back = torch.empty(max(1, check.readback_bytes), dtype=torch.uint8, device=dev)
            check.launch(kv, back)
            check.verify(back.cpu().numpy().tobytes())
        return kv


def build_splitzip_chunk(payload: np.ndarray | bytes, shape: tuple[int, ...]) -> bytes:
    """A ``format`` chunk blob around a bfloat16 ``splitzip`` payload (what ``encode_chunk`` writes)."""
    return fmt.build_chunk(memoryview(payload).cast("B"), DType.BFLOAT16, shape, {"id": "splitzip"})


__all__ = ["ExponentHashCheck", "SegmentedDigestCheck", "SplitZipGPU", "VIDEO_HEAD", "ValueCheck", "VideoPayload",
           "build_splitzip_chunk", "decode_video_chunk_nvdec", "decode_video_payload_nvdec", "is_nvdec_video",
           "parse_video_payload", "value_check"]
