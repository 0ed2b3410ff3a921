"""PyAV (bundled FFmpeg) side of the ``video`` codec: 8-bit 4:4:4 pictures to packets and back.

PyAV is imported lazily, so the package imports without it; every entry point
raises :class:`~vllm_kvcodec.errors.ConfigError` naming the extra to install.
No containers and no temp files: encoder and decoder are bare
``av.CodecContext`` objects, and the caller frames the packets itself.

Encoder settings (why each is exact is in ``docs/codec-video.md``):

* ``hevc``: libx265, ``lossless=1`` (every CU transquant-bypass: no transform,
  no quantisation, no deblocking/SAO on its samples; both are also switched
  off in the stream, so no decoder even runs them), all-intra
  (``keyint=1``, no B-frames, no lookahead/scenecut), ``info=0`` (no 2 KB
  settings SEI), single thread pool (``pools=none``, one frame thread) unless
  ``threads`` > 1. Output: Annex B, VPS/SPS/PPS in-band before the first
  picture, profile Main 4:4:4 (RExt), which NVDEC decodes since Turing.
* ``h264``: libx264, ``qp=0`` with yuv444p, i.e. High 4:4:4 Predictive with
  transform bypass (lossless), all-intra, no B-frames, no deblocking. FFmpeg decodes it;
  NVDEC does not (no H.264 4:4:4), so this backend is CPU-only.
* ``ffv1``: FFV1 version 1 (no extradata, one slice), range coder with the
  large context model (``coder=1:context=1``); lossless by design.

``gop`` (pictures per intra period) is for measurements only: the ``video``
codec stores all-intra streams (the default, ``None``). A larger ``gop`` lets
x265/x264 predict a picture from the one before it (P pictures, still no
B-frames), as KVCodec's token-per-frame layout needs; x265 has been seen to be
inexact in lossless inter coding at slower presets, so every such stream must be
decoded and compared (``tools/bench/layouts.py`` does).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np

from vllm_kvcodec.codecs.video_layout import PLANES
from vllm_kvcodec.errors import CodecError, ConfigError

BACKENDS = ("hevc", "h264", "ffv1")
ENCODERS = {"hevc": "libx265", "h264": "libx264", "ffv1": "ffv1"}
DECODERS = {"hevc": "hevc", "h264": "h264", "ffv1": "ffv1"}
PIX_FMT = "yuv444p"
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
DEFAULT_PRESET = {"hevc": "ultrafast", "h264": "veryfast", "ffv1": None}
FFV1_GOP = 64
MAX_PIXELS_SLACK = 128
INSTALL_HINT = "the 'video' codec needs PyAV: pip install 'vllm-kvcodec[video]'"


def import_av() -> Any:
    try:
        import av  # noqa: PLC0415  (optional dependency, imported on first use)
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT} ({exc})") from None
    return av


def check_available(backend: str) -> None:
    """Raise ConfigError if PyAV or this backend's encoder/decoder is missing."""
    av = import_av()
    for name, mode in ((ENCODERS[backend], "w"), (DECODERS[backend], "r")):
        try:
            av.codec.Codec(name, mode)
        except Exception as exc:  # av raises its own UnknownCodecError
            raise ConfigError(f"this FFmpeg build has no {name!r} ({'encoder' if mode == 'w' else 'decoder'}): {exc}") from None


def _encoder_options(backend: str, preset: str | None, threads: int, gop: int = 1) -> dict[str, str]:
    if backend == "hevc":
        pools = "none" if threads == 1 else str(threads)
        params = (
            f"lossless=1:keyint={gop}:min-keyint={gop}:bframes=0:scenecut=0:rc-lookahead=0:no-deblock=1:sao=0:"
            f"info=0:hash=0:aud=0:annexb=1:log-level=error:pools={pools}:frame-threads=1"
        )
        return {"preset": preset or DEFAULT_PRESET[backend], "x265-params": params}
    if backend == "h264":
        params = f"keyint={gop}:min-keyint={gop}:bframes=0:scenecut=0:rc-lookahead=0:no-deblock=1:log=-1"
        return {"preset": preset or DEFAULT_PRESET[backend], "qp": "0", "x264-params": params}
    return {"level": "1", "coder": "1", "context": "1"}


def encode_pictures(
    planes: np.ndarray, backend: str, preset: str | None, threads: int, gop: int | None = None
) -> list[bytes]:
    """Encode ``[frames, 3, height, width]`` uint8 pictures; one packet per picture. ``gop`` None: all intra
    (hevc, h264) or :data:`FFV1_GOP` (ffv1), as the ``video`` codec stores them."""
    av = import_av()
    frames, nplanes, height, width = planes.shape
    assert nplanes == PLANES
    try:
        ctx = av.CodecContext.create(ENCODERS[backend], "w")
        ctx.width, ctx.height, ctx.pix_fmt = width, height, PIX_FMT
        ctx.time_base = Fraction(1, 25)
        ctx.framerate = Fraction(25, 1)
        ctx.thread_count = threads
        if backend == "ffv1":
            ctx.gop_size = gop or FFV1_GOP
        ctx.options = _encoder_options(backend, preset, threads, gop or 1)
        packets: list[bytes] = []
        for i in range(frames):
            frame = av.VideoFrame(width, height, PIX_FMT)
            for p in range(PLANES):
                plane = frame.planes[p]
                view = np.frombuffer(plane, dtype=np.uint8).reshape(height, plane.line_size)
                view[:, :width] = planes[i, p]
            frame.pts = i
            packets.extend(bytes(pkt) for pkt in ctx.encode(frame))
        packets.extend(bytes(pkt) for pkt in ctx.encode(None))
        extradata = ctx.extradata
    except av.FFmpegError as exc:
        raise CodecError(f"{ENCODERS[backend]} failed to encode: {exc}") from None
    if extradata:
        raise CodecError(f"{ENCODERS[backend]} produced {len(extradata)} bytes of extradata; layout 1 has no room for it")
    if len(packets) != frames or any(not p for p in packets):
        raise CodecError(f"{ENCODERS[backend]} produced {len(packets)} packets for {frames} pictures")
    return packets


def decode_pictures(
    packets: list[memoryview], backend: str, width: int, height: int, threads: int = 1
) -> np.ndarray:
    """Decode one packet per picture into a new ``[frames, 3, height, width]`` uint8 array.

    Anything but exactly ``len(packets)`` yuv444p pictures of ``width`` x
    ``height`` raises CodecError; so does any libav error. The decoder is told
    the picture size it may allocate (``max_pixels``, plus CTB slack), so a
    hostile stream cannot make it allocate a huge picture.
    """
    av = import_av()
    frames = len(packets)
    out = np.empty((frames, PLANES, height, width), dtype=np.uint8)
    got = 0

    def take(decoded: list) -> None:
        nonlocal got
        for frame in decoded:
            if got >= frames:
                raise CodecError(f"{backend} stream holds more than the {frames} pictures promised")
            fmt = frame.format.name
            if (frame.width, frame.height, fmt) != (width, height, PIX_FMT):
                raise CodecError(
                    f"{backend} picture {got} is {frame.width}x{frame.height} {fmt}, expected {width}x{height} {PIX_FMT}"
                )
            for p in range(PLANES):
                plane = frame.planes[p]
                if plane.line_size < width or plane.buffer_size < plane.line_size * height:
                    raise CodecError(f"{backend} picture {got} plane {p} has an unexpected layout")
                src = np.frombuffer(plane, dtype=np.uint8, count=plane.line_size * height)
                out[got, p] = src.reshape(height, plane.line_size)[:, :width]
            got += 1

    try:
        ctx = av.CodecContext.create(DECODERS[backend], "r")
        ctx.width, ctx.height = width, height
        ctx.thread_count = threads
        # Decoders allocate whole CTBs/macroblocks (HEVC: 64 x 64), so allow that much slack.
        max_pixels = (width + MAX_PIXELS_SLACK) * (height + MAX_PIXELS_SLACK)
        ctx.options = {"max_pixels": str(max_pixels), "err_detect": "crccheck+bitstream+buffer+explode"}
        for data in packets:
            take(ctx.decode(av.Packet(bytes(data))))
        take(ctx.decode(None))
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001  libav errors, and anything else a hostile stream provokes
        raise CodecError(f"{backend} stream does not decode: {type(exc).__name__}: {exc}") from None
    if got != frames:
        raise CodecError(f"{backend} stream decoded to {got} pictures, expected {frames}")
    return out
