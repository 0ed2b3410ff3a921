"""NVDEC (and a probe of NVENC) for the ``video`` codec's HEVC streams, through PyNvVideoCodec.

The ``video`` codec (:mod:`vllm_kvcodec.codecs.video`, docs/codec-video.md)
stores a chunk's exponent bytes as 8-bit 4:4:4 pictures in a plain HEVC
Annex B elementary stream (VPS/SPS/PPS, then one IDR per picture, no
reordering), next to the raw sign+mantissa bytes. This module decodes that
stream with NVDEC into a ``[frames, 3, height, width]`` uint8 tensor on the
GPU, crops it to the exponent bytes, and joins them with the sign+mantissa
bytes into the chunk's bfloat16 values, on the device.

``PyNvVideoCodec`` is imported lazily, on first use, never at module import:
without an NVIDIA driver ``import PyNvVideoCodec`` fails, and
:func:`nvdec_available` returns ``(False, reason)`` instead of raising; the
decode functions raise :class:`NvCodecUnavailable` carrying that reason.

Status: NOT run on a GPU yet. The decoder calls are the subset PyNvVideoCodec
2.0.4 (what ``vllm==0.33.0`` pins) and 2.2.4 both offer, read from both
wheels (:mod:`.nvdec_sessions`); ``benchmarks/gpu_check.py`` is the first
place they will run. Everything after the decoder (payload parsing, cropping,
joining, the exponent checksum) is tested on the CPU with libav standing in
for NVDEC (tests/gpu/test_gpu_nvcodec.py), and the session code against a
stand-in module offering only 2.0.4's calls.

NVENC: H100/H200/A100 have none. Where a GPU has it (L4, L40S, RTX) the
``video`` codec's ``encoder="auto"`` encodes with :func:`nvenc_encode_pictures`
(lossless HEVC 4:4:4, one IDR per picture: the same layout, decoded by
libav and NVDEC alike), else with x265 on the CPU; see docs/codec-video.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import struct
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from vllm_kvcodec.errors import CodecError, ConfigError

#: Layout of the video payload header (``video._HEAD``; the tests check they agree).
VIDEO_HEAD = struct.Struct("<HHIQ")  # width, height, frames, xxh3-64 of the exponent bytes
PLANES = 3
ANNEXB_START = b"\x00\x00\x00\x01"


class NvCodecUnavailable(ConfigError):
    """PyNvVideoCodec, the NVIDIA driver or the needed decoder/encoder capability is missing."""


_NVC: Any = None
_NVC_ERROR: str | None = None


def _import_nvc() -> Any:
    """``import PyNvVideoCodec`` once; raise :class:`NvCodecUnavailable` with the reason if it fails."""
    global _NVC, _NVC_ERROR
    if _NVC is not None:
        return _NVC
    if _NVC_ERROR is None:
        try:
            _NVC = importlib.import_module("PyNvVideoCodec")
            return _NVC
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (no libcuda/libnvcuvid), anything
            _NVC_ERROR = f"PyNvVideoCodec is not importable ({type(exc).__name__}: {exc})"
    raise NvCodecUnavailable(_NVC_ERROR)


def _reset_import_cache() -> None:
    """Forget a previous import attempt (tests)."""
    global _NVC, _NVC_ERROR
    _NVC, _NVC_ERROR = None, None


def nvdec_available() -> tuple[bool, str]:
    """``(True, description)`` if NVDEC can be driven from here, else ``(False, reason)``. Never raises."""
    try:
        nvc = _import_nvc()
    except NvCodecUnavailable as exc:
        return False, str(exc)
    if not torch.cuda.is_available():
        return False, "PyNvVideoCodec imports, but torch sees no CUDA device"
    version = getattr(nvc, "__version__", "unknown version")
    return True, f"PyNvVideoCodec {version} on {torch.cuda.get_device_name()}"


# --------------------------------------------------------------------------------------
# The video payload (pure parsing; no PyNvVideoCodec)
# --------------------------------------------------------------------------------------


def _video_layout() -> Any:
    """:mod:`vllm_kvcodec.codecs.video_layout`, also where the codecs package cannot import.

    ``vllm_kvcodec.codecs`` imports every codec (numba, zstandard, PyAV...);
    ``video_layout.py`` itself is plain numpy, so on a machine that lacks the
    others (the GPU check's image) it is loaded from its file directly.
    """
    try:
        return importlib.import_module("vllm_kvcodec.codecs.video_layout")
    except ImportError:
        name = "_vllm_kvcodec_video_layout"
        if name in sys.modules:
            return sys.modules[name]
        path = Path(__file__).resolve().parents[1] / "codecs" / "video_layout.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


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
    geometry: Any  # video_layout.FrameGeometry


def parse_video_payload(payload: bytes | memoryview, shape: tuple[int, ...]) -> VideoPayload:
    """Check a bfloat16 ``video`` payload against ``shape`` (as the CPU decoder does) and split it."""
    layout = _video_layout()
    geo = layout.geometry(tuple(int(d) for d in shape))
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


def planes_to_exponents(planes: torch.Tensor, geo: Any) -> torch.Tensor:
    """Crop ``[frames, 3, height, width]`` uint8 pictures to the ``n`` exponent bytes (any device).

    Same as ``video_layout.from_planes``: rows of ``geo.row`` bytes in order,
    padding columns and rows dropped.
    """
    want = (geo.frames, PLANES, geo.height, geo.width)
    if tuple(planes.shape) != want or planes.dtype != torch.uint8:
        raise CodecError(f"decoded pictures are {tuple(planes.shape)} {planes.dtype}, expected {want} uint8")
    rows = planes.reshape(geo.plane_rows, geo.width)[: geo.rows, : geo.row]
    return rows.reshape(-1)[: geo.n]


def join_bf16(exponents: torch.Tensor, signman: torch.Tensor) -> torch.Tensor:
    """bfloat16 values from exponent bytes and sign+mantissa bytes (``sign << 7 | mantissa7``)."""
    e = exponents.to(torch.int32)
    s = signman.to(torch.int32)
    bits = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    return bits.to(torch.int16).view(torch.bfloat16)


# --------------------------------------------------------------------------------------
# NVDEC
# --------------------------------------------------------------------------------------


def _frame_planes(frame: Any, width: int, height: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """One decoded picture as a ``[3, height, width]`` uint8 tensor on ``device`` (into ``out`` when given)."""
    fmt = str(getattr(frame, "format", ""))
    if fmt and "444" not in fmt and fmt.upper() not in ("", "NONE"):
        raise NvCodecUnavailable(
            f"NVDEC returned a {fmt} picture; the exponent planes need a 4:4:4 (YUV444) surface "
            "(a 4:2:0 surface would drop three quarters of U and V)"
        )
    planes: list[torch.Tensor]
    try:
        t = torch.from_dlpack(frame)
        if t.dim() == 3 and t.shape[0] == PLANES:
            planes = [t[p] for p in range(PLANES)]
        elif t.dim() == 2 and t.shape[0] == PLANES * height:
            planes = [t[p * height : (p + 1) * height] for p in range(PLANES)]
        elif t.dim() == 3 and t.shape[-1] == PLANES:  # interleaved HWC (not expected for NATIVE output)
            planes = [t[..., p] for p in range(PLANES)]
        else:
            raise CodecError(f"unexpected DLPack picture shape {tuple(t.shape)}")
    except (TypeError, AttributeError, RuntimeError, BufferError):
        # Older API: frame.cuda() -> one __cuda_array_interface__ object per plane.
        parts = frame.cuda() if callable(getattr(frame, "cuda", None)) else None
        if not parts:
            raise CodecError("decoded frame exposes neither DLPack nor CUDA array planes") from None
        parts = list(parts)
        if len(parts) == 1:
            whole = torch.as_tensor(parts[0], device=device)
            planes = [whole[p * height : (p + 1) * height] for p in range(PLANES)]
        else:
            planes = [torch.as_tensor(p, device=device) for p in parts[:PLANES]]
    if out is None:
        out = torch.empty((PLANES, height, width), dtype=torch.uint8, device=device)
    for p, plane in enumerate(planes):
        plane = plane.reshape(plane.shape[0], -1) if plane.dim() > 2 else plane
        if plane.dtype != torch.uint8 or plane.shape[0] < height or plane.shape[1] < width:
            raise CodecError(f"decoded plane {p} is {tuple(plane.shape)} {plane.dtype}, expected >= {height}x{width} uint8")
        out[p].copy_(plane[:height, :width])
    return out


def split_packets(stream: bytes | memoryview, packet_sizes: tuple[int, ...] | list[int]) -> list[memoryview]:
    """The stream cut at the payload's packet sizes (checked against it by :func:`parse_video_payload`)."""
    view, packets, at = memoryview(stream).cast("B"), [], 0
    for size in packet_sizes:
        packets.append(view[at : at + size])
        at += size
    if at != len(view):
        raise CodecError(f"packet sizes sum to {at}, the stream holds {len(view)} bytes")
    return packets


def access_units(stream: bytes | memoryview) -> list[memoryview]:
    """An HEVC Annex B stream cut into access units (one picture each, parameter sets with the picture after them).

    For streams that come without the ``video`` payload's packet table (an
    NVENC stream, say). A new unit starts at a parameter set, an access unit
    delimiter or a prefix SEI that follows a picture's slices, and at a slice
    whose ``first_slice_segment_in_pic_flag`` is set when the unit already has a slice.
    """
    view = memoryview(stream).cast("B")
    data = bytes(view)
    starts, at = [], 0
    while (at := data.find(b"\x00\x00\x01", at)) >= 0:
        starts.append(at + 3)
        at += 3
    cuts, has_slice = [0], False
    for i, nal in enumerate(starts):
        if nal + 2 >= len(data):
            break
        kind = (data[nal] >> 1) & 0x3F
        begin = starts[i] - 3 - (1 if starts[i] >= 4 and data[starts[i] - 4] == 0 else 0)
        if kind <= 31:  # a slice
            if has_slice and data[nal + 2] & 0x80:
                cuts.append(begin)
            has_slice = True
        elif kind in (32, 33, 34, 35, 39) and has_slice:
            cuts.append(begin)
            has_slice = False
    cuts.append(len(data))
    return [view[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def nvdec_decode_planes(
    stream: bytes | memoryview, width: int, height: int, frames: int, device: torch.device | str = "cuda",
    *, packet_sizes: tuple[int, ...] | list[int] | None = None, session: Any | None = None,
) -> torch.Tensor:
    """Decode the ``video`` codec's HEVC Annex B stream with NVDEC: ``[frames, 3, height, width]`` uint8 on GPU.

    ``session``: an :class:`~vllm_kvcodec.gpu.nvdec_sessions.NvdecSession`
    to reuse (the load path and the device check keep one per thread); without
    one, a decoder is created for this call only. ``packet_sizes``: the
    payload's packet table; without it the stream is cut into access units
    (:func:`access_units`). Raises
    :class:`NvCodecUnavailable` when PyNvVideoCodec/NVDEC cannot be used,
    :class:`CodecError` when the stream does not decode to exactly ``frames``
    4:4:4 pictures of the given size.
    """
    from vllm_kvcodec.gpu.nvdec_sessions import NvdecSession

    device = torch.device(device)
    if session is None:
        _import_nvc()
        if device.type != "cuda" or not torch.cuda.is_available():
            raise NvCodecUnavailable(f"NVDEC decodes into CUDA memory; {device} is not a usable CUDA device")
    data = bytes(stream)
    if not data.startswith(ANNEXB_START) and not data.startswith(ANNEXB_START[1:]):
        raise CodecError("not an Annex B elementary stream (no start code)")
    packets = split_packets(data, packet_sizes) if packet_sizes is not None else access_units(data)
    if len(packets) != frames:
        raise CodecError(f"{len(packets)} packets for {frames} pictures")
    out = torch.empty((frames, PLANES, height, width), dtype=torch.uint8, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
        decoder = session if session is not None else NvdecSession(device)
        decoder.decode_into(packets, width, height, out)
    return out


def _nullcontext() -> Any:
    import contextlib

    return contextlib.nullcontext()


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

    ``verify_hash`` checks the payload's XXH3-64 of the exponent bytes (needs
    xxhash; one device-to-host copy of ``n`` bytes), as the CPU decoder does.
    ``planes_decoder`` replaces NVDEC (the tests use libav); ``session`` is
    a decoder session to reuse (see :func:`nvdec_decode_planes`). The load
    path does not come here: :mod:`vllm_kvcodec.load.cuda_placement` joins and
    checks on the device (:mod:`.nvdec_join_triton`).
    """
    device = torch.device(device)
    parsed = parse_video_payload(payload, shape)
    if planes_decoder is not None:
        planes = planes_decoder(bytes(parsed.stream), parsed.width, parsed.height, parsed.frames, device)
    else:
        planes = nvdec_decode_planes(parsed.stream, parsed.width, parsed.height, parsed.frames, device,
                                     packet_sizes=parsed.packet_sizes, session=session)
    exps = planes_to_exponents(planes, parsed.geometry)
    if verify_hash:
        import xxhash

        if xxhash.xxh3_64_intdigest(exps.cpu().numpy().tobytes()) != parsed.exp_hash:
            raise CodecError("video hevc stream decoded to exponents that fail their checksum")
    signman = torch.frombuffer(bytearray(parsed.signman), dtype=torch.uint8).to(device)
    return join_bf16(exps, signman).reshape(tuple(shape))


def decode_video_chunk_nvdec(
    blob: bytes | bytearray | memoryview,
    device: torch.device | str = "cuda",
    *,
    verify_hash: bool = True,
    planes_decoder: Callable[[bytes, int, int, int, torch.device], torch.Tensor] | None = None,
    session: Any | None = None,
) -> torch.Tensor:
    """Decode a bfloat16 ``video``/``hevc`` chunk blob on the GPU: :func:`decode_video_payload_nvdec` after
    :func:`vllm_kvcodec.format.read_header` (which checks the header and the chunk checksum)."""
    from vllm_kvcodec.dtypes import DType
    from vllm_kvcodec.format import payload_of, read_header

    header = read_header(blob)
    config = header.codec_config
    if config.get("id") != "video" or config.get("backend") != "hevc" or header.dtype is not DType.BFLOAT16:
        raise ConfigError(f"NVDEC decodes bfloat16 'video' chunks with backend 'hevc', not {config} {header.dtype.name}")
    return decode_video_payload_nvdec(payload_of(blob, header), header.shape, device, verify_hash=verify_hash,
                                      planes_decoder=planes_decoder, session=session)


# --------------------------------------------------------------------------------------
# NVENC (probe only: datacenter Hopper/Ampere parts have none)
# --------------------------------------------------------------------------------------


#: NVENC settings for the ``video`` layout: lossless HEVC 4:4:4, every picture an IDR, no B-frames. Keys both
#: PyNvVideoCodec 2.0.4 and 2.2.4 accept (CreateEncoder's Python wrapper is the same in both).
NVENC_OPTIONS = {"codec": "hevc", "tuning_info": "lossless", "preset": "P1", "gop": "1", "idrperiod": "1", "bf": "0"}


def nvenc_encode_pictures(planes: np.ndarray, **options: Any) -> list[bytes]:
    """Lossless HEVC 4:4:4 of ``[frames, 3, H, W]`` uint8 planes with NVENC (host input): one packet per picture.

    Runs on the caller's thread with NVENC's own CUDA stream (the saver's
    background threads: never the engine's stream). Raises
    :class:`NvCodecUnavailable` where NVENC cannot encode here, and
    :class:`CodecError` when it does not give exactly one packet per picture
    (the layout needs them apart).
    """
    nvc = _import_nvc()
    frames, _, height, width = planes.shape
    params = {**NVENC_OPTIONS, **options}
    try:
        encoder = nvc.CreateEncoder(width, height, "YUV444", True, **params)
    except Exception as exc:  # noqa: BLE001
        raise NvCodecUnavailable(f"NVENC encoder not available: {type(exc).__name__}: {exc}") from None
    packets: list[bytes] = []
    try:
        for f in range(frames):
            if out := bytes(encoder.Encode(np.ascontiguousarray(planes[f]).reshape(-1))):
                packets.append(out)
        if tail := bytes(encoder.EndEncode()):
            packets.append(tail)
    except Exception as exc:  # noqa: BLE001
        raise NvCodecUnavailable(f"NVENC encode failed: {type(exc).__name__}: {exc}") from None
    if len(packets) != frames:
        raise CodecError(f"NVENC gave {len(packets)} packets for {frames} pictures")
    return packets


def nvenc_encode_planes(planes: np.ndarray, **options: Any) -> bytes:
    """:func:`nvenc_encode_pictures`' packets back to back: the elementary stream."""
    return b"".join(nvenc_encode_pictures(planes, **options))


_NVENC: tuple[bool, str] | None = None


def nvenc_usable() -> tuple[bool, str]:
    """:func:`nvenc_available`, probed once per process (the save path asks for every chunk)."""
    global _NVENC
    if _NVENC is None:
        _NVENC = nvenc_available()
    return _NVENC


def nvenc_available() -> tuple[bool, str]:
    """Probe NVENC with one lossless 4:4:4 HEVC picture; ``(ok, reason)``, never raises."""
    ok, reason = nvdec_available()
    if not ok:
        return False, reason
    try:
        nvenc_encode_planes(np.zeros((1, PLANES, 144, 144), dtype=np.uint8))
    except NvCodecUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001
        return False, f"NVENC probe failed: {type(exc).__name__}: {exc}"
    return True, "NVENC encoded a lossless HEVC 4:4:4 picture"


__all__ = [
    "NvCodecUnavailable", "VideoPayload", "decode_video_chunk_nvdec", "decode_video_payload_nvdec", "join_bf16", "nvdec_available",
    "nvdec_decode_planes", "nvenc_available", "nvenc_encode_pictures", "nvenc_encode_planes", "nvenc_usable",
    "parse_video_payload", "planes_to_exponents", "split_packets", "access_units",
]
