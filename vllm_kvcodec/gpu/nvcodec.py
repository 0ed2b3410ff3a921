"""NVDEC and NVENC for the ``video`` codec's HEVC streams, through PyNvVideoCodec: device plumbing only.

The ``video`` codec (:mod:`vllm_kvcodec.codecs.video`, docs/codec-video.md)
stores a chunk's exponent bytes as 8-bit 4:4:4 pictures in a plain HEVC
Annex B elementary stream (VPS/SPS/PPS, then one IDR per picture, no
reordering). This module decodes such a stream with NVDEC into a ``[frames, 3,
height, width]`` uint8 tensor on the GPU, crops and joins pictures (given a
geometry), and encodes pictures with NVENC where a GPU has one. It reads no
chunk format and imports no codec: what parses a chunk or a ``video`` payload
for it is :mod:`vllm_kvcodec.format.device_chunks`, above both.

``PyNvVideoCodec`` is imported lazily, on first use, never at module import:
without an NVIDIA driver ``import PyNvVideoCodec`` fails, and
:func:`nvdec_available` returns ``(False, reason)`` instead of raising; the
decode functions raise :class:`NvCodecUnavailable` carrying that reason.
PyNvVideoCodec 2.0.4's ``__init__`` asks ``libnvidia-encode.so.1`` for its
version before anything else, so where that library is missing but the
decoder's ``libnvcuvid.so.1`` is there (a GPU without NVENC whose container
mounts only the decoder), its native module is loaded directly
(:func:`_load_decoder_module`): NVDEC works, NVENC does not.

Status: NOT run on a GPU yet. The calls are the subset PyNvVideoCodec 2.0.4
(what ``vllm==0.33.0`` pins) and 2.2.4 both offer, read from both wheels
(:mod:`.nvdec_sessions`); ``benchmarks/gpu_check.py`` is the first place they
will run. Everything is tested on the CPU against a stand-in of 2.0.4's API
with libav behind it (:mod:`vllm_kvcodec.tools.gpu_nvc_stand_in`).

NVENC: H100/H200/A100 have none. Where a GPU has it (L4, L40S, RTX) the
``video`` codec's ``encoder="auto"`` encodes with :func:`nvenc_encode_pictures`
(lossless HEVC 4:4:4, one IDR per picture: the same layout, decoded by
libav and NVDEC alike), else with x265 on the CPU; see docs/codec-video.md.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.machinery
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_kvcodec.errors import CodecError, ConfigError

PLANES = 3
ANNEXB_START = b"\x00\x00\x00\x01"
#: The driver's video libraries: NVDEC's and NVENC's. A container gets them with the ``video`` driver capability.
NVCUVID, NVENCODE = "libnvcuvid.so.1", "libnvidia-encode.so.1"
#: PyNvVideoCodec's native modules, newest NVENC API first (2.0.4 picks one by the NVENC driver version).
DECODER_MODULES = ("PyNvVideoCodec_130", "PyNvVideoCodec_121")
DECODER_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


class NvCodecUnavailable(ConfigError):
    """PyNvVideoCodec, the NVIDIA driver or the needed decoder/encoder capability is missing."""


_NVC: Any = None
_NVC_ERROR: str | None = None


def import_nvc() -> Any:
    """``import PyNvVideoCodec`` once (else its decoder module directly); raise :class:`NvCodecUnavailable` if neither."""
    global _NVC, _NVC_ERROR
    if _NVC is not None:
        return _NVC
    if _NVC_ERROR is None:
        try:
            _NVC = importlib.import_module("PyNvVideoCodec")
            return _NVC
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (no libcuda/libnvcuvid), RuntimeError, anything
            _NVC_ERROR = f"PyNvVideoCodec is not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
        if not have_library(NVENCODE) and have_library(NVCUVID):
            try:
                _NVC = _load_decoder_module()
                return _NVC
            except Exception as exc:  # noqa: BLE001
                _NVC_ERROR += f"; its decoder module did not load either ({type(exc).__name__}: {exc})"
    raise NvCodecUnavailable(_NVC_ERROR)


def have_library(name: str) -> bool:
    """Whether the dynamic loader finds ``name`` (a driver library) in this process."""
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def driver_video_libraries() -> dict[str, bool]:
    """Which of the driver's video libraries this process can load (both missing: no ``video`` capability)."""
    return {name: have_library(name) for name in (NVCUVID, NVENCODE)}


def _load_decoder_module() -> Any:
    """PyNvVideoCodec's native module loaded by path, bypassing the package ``__init__`` (which needs NVENC).

    It holds ``CreateDecoder``, ``GetDecoderCaps``, ``PacketData`` and the
    enums; it links ``libcuda`` and its own FFmpeg and CUDA runtime, and opens
    ``libnvcuvid`` when a decoder is made. ``CreateEncoder`` (Python, in the
    ``__init__``) is absent: NVENC stays unavailable.
    """
    spec = importlib.util.find_spec("PyNvVideoCodec")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("PyNvVideoCodec is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    for name in DECODER_MODULES:
        for suffix in DECODER_SUFFIXES:
            for path in sorted(glob.glob(os.path.join(glob.escape(str(folder)), name + suffix))):
                module_spec = importlib.util.spec_from_file_location("_PyNvVideoCodec", path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                return module
    raise ImportError(f"no {' or '.join(DECODER_MODULES)} module in {folder}")


def _reset_import_cache() -> None:
    """Forget a previous import attempt (tests)."""
    global _NVC, _NVC_ERROR
    _NVC, _NVC_ERROR = None, None


def nvdec_available() -> tuple[bool, str]:
    """``(True, description)`` if NVDEC can be driven from here, else ``(False, reason)``. Never raises."""
    try:
        nvc = import_nvc()
    except NvCodecUnavailable as exc:
        return False, str(exc)
    if not torch.cuda.is_available():
        return False, "PyNvVideoCodec imports, but torch sees no CUDA device"
    version = getattr(nvc, "__version__", "unknown version")
    return True, f"PyNvVideoCodec {version} on {torch.cuda.get_device_name()}"


# --------------------------------------------------------------------------------------
# Pictures -> values
# --------------------------------------------------------------------------------------


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
    nvc = import_nvc()
    frames, _, height, width = planes.shape
    params = {**NVENC_OPTIONS, **options}
    try:
        encoder = nvc.CreateEncoder(width, height, "YUV444", True, **params)
    except Exception as exc:  # noqa: BLE001
        raise NvCodecUnavailable(f"NVENC encoder not available: {type(exc).__name__}: {exc}") from None
    packets: list[bytes] = []
    try:
        for f in range(frames):
            packets += encoded_packets(encoder.Encode(np.ascontiguousarray(planes[f]).reshape(-1)))
        packets += encoded_packets(encoder.EndEncode())
    except Exception as exc:  # noqa: BLE001
        raise NvCodecUnavailable(f"NVENC encode failed: {type(exc).__name__}: {exc}") from None
    if len(packets) != frames:
        raise CodecError(f"NVENC gave {len(packets)} packets for {frames} pictures")
    return packets


def encoded_packets(out: Any) -> list[bytes]:
    """The packets in what ``Encode``/``EndEncode`` returned: in 2.0.4 a list of dicts ``{'data': bytes,
    'timestamp', 'picture_type'}`` (possibly empty: NVENC has latency); a bare bytes-like packet is taken too."""
    if out is None:
        return []
    if isinstance(out, (bytes, bytearray, memoryview, np.ndarray)):
        data = bytes(memoryview(out).cast("B")) if not isinstance(out, np.ndarray) else out.tobytes()
        return [data] if data else []
    packets = []
    for item in out:
        data = item["data"] if isinstance(item, dict) else item
        if len(data):
            packets.append(bytes(data))
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
    "NVCUVID", "NVENCODE", "NvCodecUnavailable", "access_units", "driver_video_libraries", "encoded_packets",
    "have_library", "join_bf16", "nvdec_available", "nvenc_available", "nvenc_encode_pictures",
    "nvenc_encode_planes", "nvenc_usable", "planes_to_exponents", "split_packets",
]
