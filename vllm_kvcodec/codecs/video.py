"""KVCodec-style (arXiv 2602.09725) lossless video coding of the exponent plane, on the CPU via PyAV.

Each value splits into its exponent byte and its sign+mantissa bits, as in
SplitZip. The exponent bytes become 8-bit 4:4:4 pictures (three planes of a
picture hold three consecutive row blocks; geometry in
:mod:`.video_layout`) and go through a lossless video codec: HEVC (libx265,
the default: its bitstream is what NVDEC decodes on every NVIDIA datacenter
GPU since Turing), H.264 (libx264, CPU decode only) or FFV1. The
sign+mantissa bits are stored raw beside the stream: they are incompressible
and every video codec expands them.

Config: ``{"id": "video", "backend": "hevc"|"h264"|"ffv1", "layout": 1}``.
Encoder-only parameters (not stored, not needed to decode): ``encoder``
(hevc only: ``"auto"``, the default, encodes with NVENC where this process
has a GPU with NVENC and with x265 otherwise; ``"x265"``; ``"nvenc"``, which
fails where there is none: either gives the same layout, one IDR picture per
packet, which libav and NVDEC both decode), ``preset``
(x265/x264 preset; default ultrafast for hevc, veryfast for h264),
``threads`` (libav thread count for encoder and decoder, default 1) and
``verify`` (default True: decode the new stream and compare before returning,
so an encoder bug fails the write instead of making a chunk that never
decodes).

Payload (little-endian; ``n`` elements; ``r`` sign+mantissa bytes per element:
1 for bfloat16, 3 for float32; ``frames``, ``width``, ``height`` must equal
the layout's geometry for the chunk's shape)::

    width      u16            picture width in pixels
    height     u16            picture height in pixels (each of the 3 planes)
    frames     u32            number of pictures (>= 1)
    exp_hash   u64            XXH3-64 of the n exponent bytes, in element order
    signman    n*r x u8       bf16: sign<<7 | mantissa7;  f32: sign<<23 | mantissa23, 3 bytes LE
    sizes      frames x u32   byte length of each picture's packet (each >= 1)
    stream     sum(sizes) x u8

``stream`` is the packets back to back, one picture each. For ``hevc`` it is
a plain Annex B elementary stream (VPS/SPS/PPS, then one IDR access unit per
picture), decodable as a whole by NVDEC or any HEVC decoder; for ``h264`` an
Annex B stream likewise; for ``ffv1`` FFV1 version 1 frames (no extradata).

The decoder checks every size against the shape before it allocates, decodes
with a libav decoder capped at the expected picture size, requires exactly
``frames`` yuv444p pictures of the right size, and finally compares the
cropped exponents against ``exp_hash``: a stream that decodes, but not to the
encoded exponents (concealed corruption, a decoder or encoder bug), raises
:class:`~vllm_kvcodec.errors.CodecError` rather than returning wrong data.

Every chunk this codec writes also carries the chunk format's value digest
(flag ``VALUE_DIGEST``, segments of :attr:`VideoCodec.value_digest_segment`
bytes, docs/format.md): a GPU checks NVDEC's output against it with one
program per segment, where ``exp_hash`` (one sequential XXH3 walk) would cap
the load at a few GB/s; ``exp_hash`` stays for chunks written before.

float16 (5-bit exponent, 11 sign+mantissa bits) has no byte-aligned split:
the codec refuses it (use ``zstd`` or ``raw``).
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import xxhash

from vllm_kvcodec.codecs import video_av
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.registry import register_codec
from vllm_kvcodec.codecs.validate import Reader
from vllm_kvcodec.codecs.video_layout import LAYOUT_VERSION, FrameGeometry, from_planes, geometry, to_planes
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import CodecError, ConfigError

_HEAD = struct.Struct("<HHIQ")  # width, height, frames, exp_hash
MAX_THREADS = 64
ENCODERS = ("auto", "x265", "nvenc")
logger = logging.getLogger("vllm_kvcodec")
_NVENC_FAILED: list[str] = []  # why NVENC gave up mid-run (logged once; x265 from then on)


@register_codec
class VideoCodec(Codec):
    codec_id = "video"
    dtypes = frozenset({DType.BFLOAT16, DType.FLOAT32})
    #: Chunks carry a value digest of this segment size (the format's ``encode_chunk`` reads it).
    value_digest_segment = 16384

    def __init__(
        self,
        backend: str = "hevc",
        layout: int = LAYOUT_VERSION,
        preset: str | None = None,
        threads: int = 1,
        verify: bool = True,
        encoder: str = "auto",
    ) -> None:
        if backend not in video_av.BACKENDS:
            raise ConfigError(f"video backend {backend!r} is not one of {', '.join(video_av.BACKENDS)}")
        if type(layout) is not int or layout != LAYOUT_VERSION:
            raise ConfigError(f"video layout {layout!r} is unknown (this reader knows {LAYOUT_VERSION})")
        if preset is not None and (backend == "ffv1" or preset not in video_av.PRESETS):
            raise ConfigError(f"video preset {preset!r} is not valid for backend {backend!r}")
        if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
            raise ConfigError(f"video threads must be an int in [1, {MAX_THREADS}], got {threads!r}")
        if not isinstance(verify, bool):
            raise ConfigError(f"video verify must be a bool, got {verify!r}")
        if encoder not in ENCODERS or (encoder == "nvenc" and backend != "hevc"):
            raise ConfigError(f"video encoder {encoder!r} is not one of {', '.join(ENCODERS)} (nvenc: backend hevc only)")
        self.encoder = encoder
        self.backend = backend
        self.layout = layout
        self.preset = preset
        self.threads = threads
        self.verify = verify

    def get_config(self) -> dict:
        # Only what a decoder needs; preset/threads/verify change nothing in the format.
        return {"id": self.codec_id, "backend": self.backend, "layout": self.layout}

    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        self.check_dtype(dtype)
        video_av.check_available(self.backend)
        bits = np.ascontiguousarray(bits, dtype=dtype.bits_dtype)
        geo = geometry(tuple(bits.shape))
        exps, signman = split(bits.reshape(-1), dtype)
        planes = to_planes(exps, geo)
        packets = self._encode_pictures(planes)
        if self.verify:
            back = video_av.decode_pictures(
                [memoryview(p) for p in packets], self.backend, geo.width, geo.height, self.threads
            )
            if not np.array_equal(back, planes):
                raise CodecError(
                    f"{video_av.ENCODERS[self.backend]} did not encode {geo.width}x{geo.height} pictures "
                    "bit-exactly; refusing to store this chunk"
                )
        head = _HEAD.pack(geo.width, geo.height, geo.frames, xxhash.xxh3_64_intdigest(exps))
        sizes = np.array([len(p) for p in packets], dtype="<u4").tobytes()
        return b"".join([head, signman.tobytes(), sizes, *packets])

    def _encode_pictures(self, planes: np.ndarray) -> list[bytes]:
        """NVENC where asked for or (``auto``) present, else the libav encoder; one packet per picture either way."""
        if self.backend == "hevc" and self.encoder != "x265" and not _NVENC_FAILED:
            from vllm_kvcodec.gpu import nvcodec

            ok, reason = nvcodec.nvenc_usable()
            if ok:
                try:
                    return nvcodec.nvenc_encode_pictures(planes)
                except (nvcodec.NvCodecUnavailable, CodecError) as exc:
                    if self.encoder == "nvenc":
                        raise
                    _NVENC_FAILED.append(str(exc))
                    logger.warning("kvcodec video: NVENC failed (%s); encoding with x265 from now on", exc)
            elif self.encoder == "nvenc":
                raise ConfigError(f"video encoder 'nvenc' asked for, but NVENC cannot encode here: {reason}")
        return video_av.encode_pictures(planes, self.backend, self.preset, self.threads)

    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        if not self.supports(dtype):
            raise CodecError(f"video payload cannot hold {dtype.name.lower()}")
        try:
            geo = geometry(tuple(shape))
        except ValueError as exc:
            raise CodecError(f"video payload: {exc}") from None
        reader = Reader(payload, "video payload")
        width, height, frames, exp_hash = _HEAD.unpack(reader.take(_HEAD.size, "header"))
        if (width, height, frames) != (geo.width, geo.height, geo.frames):
            raise CodecError(
                f"video payload promises {frames} pictures of {width}x{height}; "
                f"shape {tuple(shape)} needs {geo.frames} of {geo.width}x{geo.height}"
            )
        rest = 1 if dtype is DType.BFLOAT16 else 3
        signman = np.frombuffer(reader.take(geo.n * rest, "sign-mantissa"), dtype=np.uint8)
        sizes = np.frombuffer(reader.take(4 * frames, "packet sizes"), dtype="<u4").astype(np.int64)
        if sizes.size and (sizes.min() < 1 or int(sizes.sum()) != reader.remaining):
            raise CodecError(
                f"video packet sizes (sum {int(sizes.sum())}, min {int(sizes.min())}) "
                f"do not match the {reader.remaining} stream bytes"
            )
        packets = [reader.take(int(s), f"packet {i}") for i, s in enumerate(sizes)]
        reader.finish()
        video_av.check_available(self.backend)
        planes = video_av.decode_pictures(packets, self.backend, geo.width, geo.height, self.threads)
        exps = from_planes(planes, geo)
        if xxhash.xxh3_64_intdigest(exps) != exp_hash:
            raise CodecError(f"video {self.backend} stream decoded to exponents that fail their checksum")
        return join(exps, signman, dtype).reshape(shape)


def split(flat: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """Exponent bytes and the raw sign+mantissa bytes (``n`` or ``3n``) of flat element bits."""
    if dtype is DType.BFLOAT16:
        exps = ((flat >> 7) & 0xFF).astype(np.uint8)
        signman = (((flat >> 8) & 0x80) | (flat & 0x7F)).astype(np.uint8)
        return exps, signman
    if dtype is DType.FLOAT32:
        exps = ((flat >> 23) & 0xFF).astype(np.uint8)
        rest = ((flat & 0x7FFFFF) | ((flat >> 8) & 0x800000)).astype("<u4")
        return exps, np.ascontiguousarray(rest.view(np.uint8).reshape(-1, 4)[:, :3])
    raise CodecError(f"video codec cannot split {dtype.name.lower()}")


def join(exps: np.ndarray, signman: np.ndarray, dtype: DType) -> np.ndarray:
    """Inverse of :func:`split`: a new array of ``dtype.bits_dtype``."""
    n = exps.size
    if dtype is DType.BFLOAT16:
        e = exps.astype(np.uint16)
        s = signman.astype(np.uint16)
        return ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    rest = np.zeros((n, 4), dtype=np.uint8)
    rest[:, :3] = signman.reshape(n, 3)
    r = rest.view("<u4").reshape(n).astype(np.uint32)
    return ((r & 0x800000) << 8) | (exps.astype(np.uint32) << 23) | (r & 0x7FFFFF)


__all__ = ["FrameGeometry", "VideoCodec", "geometry", "join", "split"]
