"""A stand-in for PyNvVideoCodec 2.0.4 on a machine without NVIDIA's driver: the tests' and the dry run's NVDEC/NVENC.

It offers what ``vllm_kvcodec.gpu`` calls, with the behaviour read from the
2.0.4 wheel and its source, so the CPU suite fails where a device would
(docs/gpu.md, issue 43):

* the enums' real member names: ``cudaVideoChromaFormat`` has ``Monochrome``,
  ``420``, ``422``, ``444`` (no ``YUV444``: reach ``444`` with ``getattr``);
  ``cudaVideoCodec.HEVC``, ``DisplayDecodeLatencyType.ZERO``,
  ``VideoPacketFlag.ENDOFPICTURE``, ``Pixel_Format.YUV444``;
* ``GetDecoderCaps`` returns a dict (``supported``, ``num_decoder_engines``,
  ``width_min/max``, ``height_min/max``, ...), as the real one does;
* a decoder is sized by its first picture (or ``maxwidth``/``maxheight``): a
  smaller picture later comes back scaled to the first size (NvDecoder keeps
  its display size on a reconfigure), a larger one raises "Reconfigure Not
  supported when width/height > maxwidth/maxheight";
* ``Decode`` returns frames that are views of the decoder's own frame buffer,
  which the next ``Decode`` overwrites: a frame must be copied before then;
* errors: :class:`PyNvVCException` for a stream it cannot decode,
  :class:`PyNvVCExceptionUnsupported` for what this GPU cannot do (a picture
  outside the caps, or every decode when built with ``unsupported=True``);
* NVENC (``nvenc=True``): ``CreateEncoder(w, h, "YUV444", True, **opts)``
  whose ``Encode``/``EndEncode`` return lists of dicts ``{'data': bytes,
  'timestamp': int, 'picture_type': int}``, one picture of latency.

The pictures behind a packet come from ``pictures``: libav on the CPU
(:class:`LibavPictures`, needs PyAV) or a table of known pictures
(:class:`KnownPictures`, for the dry run where PyAV is blocked).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch


class PyNvVCException(Exception):
    """PyNvVideoCodec's generic error (a stream it cannot decode, a reconfigure it refuses)."""


class PyNvVCExceptionUnsupported(Exception):
    """PyNvVideoCodec's error for what the GPU or the library does not support."""


class _Member:
    def __init__(self, enum: str, name: str) -> None:
        self.enum, self.name = enum, name

    def __repr__(self) -> str:
        return f"<{self.enum}.{self.name}>"

    __str__ = __repr__


class _Enum:
    """A pybind11 enum: members as attributes (``getattr(e, "444")`` for names that are not identifiers)."""

    def __init__(self, enum: str, *names: str) -> None:
        self.__members__ = {name: _Member(enum, name) for name in names}
        for name, member in self.__members__.items():
            setattr(self, name, member)


class PacketData:
    """2.0.4's PacketData: these read-write fields and no others."""

    __slots__ = ("key", "pts", "dts", "pos", "bsl", "bsl_data", "duration", "decode_flag", "stream_index",
                 "is_video", "discardable", "seek_pts", "bDiscontinuity")


class Pictures(Protocol):
    def __call__(self, packet: bytes) -> np.ndarray | None:
        """The ``[3, height, width]`` uint8 picture in ``packet`` (None if it holds none); ValueError if damaged."""


class LibavPictures:
    """One libav HEVC decoder (as one NVDEC session is one decoder), fed packet by packet."""

    def __init__(self) -> None:
        import av

        self.ctx = av.CodecContext.create("hevc", "r")
        self.ctx.options = {"err_detect": "crccheck+bitstream+buffer+explode"}  # an error, as NVDEC's parser raises

    def __call__(self, packet: bytes) -> np.ndarray | None:
        import av

        try:
            frames = list(self.ctx.decode(av.Packet(packet)))
        except (av.error.FFmpegError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        if not frames:
            return None
        f = frames[-1]
        if f.format.name != "yuv444p":
            raise ValueError(f"libav decoded a {f.format.name} picture")
        return np.stack([np.frombuffer(f.planes[p], np.uint8).reshape(f.height, -1)[:, : f.width] for p in range(3)])


class KnownPictures:
    """Packets whose pictures are known in advance (placeholder streams of the dry run without PyAV)."""

    def __init__(self, table: dict[bytes, np.ndarray]) -> None:
        self.table = table

    def __call__(self, packet: bytes) -> np.ndarray | None:
        if packet not in self.table:
            raise ValueError("not a known packet")
        return self.table[packet]


class Frame:
    """A decoded picture: DLPack over ``[3 * height, width]`` rows of the decoder's frame buffer (no copy)."""

    def __init__(self, view: torch.Tensor, fmt: Any) -> None:
        self._view, self.format = view, fmt

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._view.__dlpack__()

    def __dlpack_device__(self) -> Any:
        return self._view.__dlpack_device__()


class Decoder:
    """What ``CreateDecoder`` returns: sized by its first picture, one frame buffer reused by every ``Decode``."""

    def __init__(self, nvc: StandInNvc, maxwidth: int, maxheight: int) -> None:
        self.nvc, self.maxwidth, self.maxheight = nvc, maxwidth, maxheight
        self.pictures = nvc.pictures()
        self.size: tuple[int, int] | None = None  # (width, height) of the decoded surface
        self.buffer: torch.Tensor | None = None

    def Decode(self, packet: PacketData) -> list[Frame]:  # noqa: N802 - PyNvVideoCodec's name
        if self.nvc.unsupported:
            raise PyNvVCExceptionUnsupported("HEVC 4:4:4 decode is not supported on this GPU")
        try:
            picture = self.pictures(ctypes.string_at(packet.bsl_data, packet.bsl))
        except ValueError as exc:
            raise PyNvVCException(f"cuvidParseVideoData failed: {exc}") from None
        if picture is None:
            return []
        height, width = picture.shape[1:]
        self._check_caps(width, height)
        if self.size is None:
            self.size = (width, height)
            self.maxwidth, self.maxheight = max(self.maxwidth, width), max(self.maxheight, height)
            self.buffer = torch.empty((3 * height, width), dtype=torch.uint8)
        elif (width, height) != self.size:
            if width > self.maxwidth or height > self.maxheight:
                raise PyNvVCException("Reconfigure Not supported when width/height > maxwidth/maxheight")
            picture = _scaled(picture, *self.size)  # NvDecoder keeps its display size: scaled output
        self.buffer.copy_(torch.from_numpy(np.ascontiguousarray(picture)).reshape(self.buffer.shape))
        return [Frame(self.buffer, self.nvc.Pixel_Format.YUV444)]

    def _check_caps(self, width: int, height: int) -> None:
        caps = self.nvc.caps
        if not (caps["width_min"] <= width <= caps["width_max"] and caps["height_min"] <= height <= caps["height_max"]):
            raise PyNvVCExceptionUnsupported(f"{width}x{height} is outside this GPU's HEVC decode sizes")


def _scaled(picture: np.ndarray, width: int, height: int) -> np.ndarray:
    """Nearest-neighbour scaling of ``[3, h, w]`` to ``[3, height, width]``."""
    _, h, w = picture.shape
    rows = np.arange(height) * h // height
    cols = np.arange(width) * w // width
    return picture[:, rows][:, :, cols]


class Encoder:
    """NVENC's encoder: host pictures in, one packet per picture out as lists of dicts, one picture of latency."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pending: list[dict] = []
        self.frames = 0

    def Encode(self, frame: np.ndarray) -> list[dict]:  # noqa: N802
        from vllm_kvcodec.codecs import video_av

        flat = np.asarray(frame, dtype=np.uint8).reshape(-1)
        if flat.size != 3 * self.width * self.height:
            raise PyNvVCException(f"frame of {flat.size} bytes for {self.width}x{self.height} YUV444")
        picture = flat.reshape(1, 3, self.height, self.width)
        (data,) = video_av.encode_pictures(picture, "hevc", None, 1)
        self.pending.append({"data": bytes(data), "timestamp": self.frames, "picture_type": 3})
        self.frames += 1
        return [self.pending.pop(0)] if len(self.pending) > 1 else []

    def EndEncode(self) -> list[dict]:  # noqa: N802
        out, self.pending = self.pending, []
        return out


class StandInNvc:
    """The module ``PyNvVideoCodec`` 2.0.4 as far as vllm_kvcodec uses it (see the module docstring)."""

    __version__ = "2.1.1"  # what the 2.0.4 wheel says
    PyNvVCException = PyNvVCException
    PyNvVCExceptionUnsupported = PyNvVCExceptionUnsupported
    PacketData = PacketData
    cudaVideoCodec = _Enum("cudaVideoCodec", "MPEG1", "MPEG2", "MPEG4", "VC1", "H264", "JPEG", "H264_SVC", "H264_MVC",
                           "HEVC", "VP8", "VP9", "AV1", "YUV420", "YV12", "NV12", "YUYV", "UYVY")
    cudaVideoChromaFormat = _Enum("cudaVideoChromaFormat", "Monochrome", "420", "422", "444")
    Pixel_Format = _Enum("Pixel_Format", "NV12", "YUV444", "P016", "YUV444_16Bit", "NV16", "P216", "RGB", "RGBP")
    DisplayDecodeLatencyType = _Enum("DisplayDecodeLatencyType", "NATIVE", "LOW", "ZERO")
    VideoPacketFlag = _Enum("VideoPacketFlag", "ENDOFSTREAM", "ENDOFPICTURE", "TIMESTAMP", "DISCONTINUITY")
    OutputColorType = _Enum("OutputColorType", "NATIVE", "RGB", "RGBP")

    def __init__(self, pictures: Callable[[], Pictures] = LibavPictures, *, engines: int = 7,
                 max_size: tuple[int, int] = (8192, 8192), unsupported: bool = False, nvenc: bool = False) -> None:
        self.pictures, self.unsupported, self.nvenc = pictures, unsupported, nvenc
        self.caps = {"supported": 1, "num_decoder_engines": engines, "width_min": 144, "height_min": 144,
                     "width_max": max_size[0], "height_max": max_size[1], "mb_num_max": 262144, "bitdepth": 8}
        self.decoders: list[Decoder] = []
        self.create_calls: list[dict] = []

    def CreateDecoder(self, gpuid: int = 0, codec: Any = None, cudacontext: int = 0, cudastream: int = 0,  # noqa: N802
                      usedevicememory: bool = False, maxwidth: int = 0, maxheight: int = 0, outputColorType: Any = None,
                      enableSEIMessage: bool = False, bWaitForSessionWarmUp: bool = False, latency: Any = None) -> Decoder:
        self.create_calls.append({"codec": codec, "usedevicememory": usedevicememory, "maxwidth": maxwidth,
                                  "maxheight": maxheight, "latency": latency, "cudastream": cudastream})
        if codec is not self.cudaVideoCodec.HEVC:
            raise PyNvVCExceptionUnsupported(f"codec {codec} is not HEVC")
        self.decoders.append(Decoder(self, int(maxwidth), int(maxheight)))
        return self.decoders[-1]

    def GetDecoderCaps(self, gpuid: int = 0, codec: Any = None, chromaformat: Any = None,  # noqa: N802
                       bitdepth: int = 8) -> dict:
        if chromaformat is None:
            chromaformat = getattr(self.cudaVideoChromaFormat, "420")
        ok = codec is self.cudaVideoCodec.HEVC and chromaformat in self.cudaVideoChromaFormat.__members__.values()
        return {**self.caps, "codec_id": codec, "chromaformat_id": chromaformat, "bitdepth": bitdepth,
                "supported": int(ok and bool(self.caps["supported"]))}

    def CreateEncoder(self, width: int, height: int, fmt: str, usecpuinputbuffer: bool, **kwargs: Any) -> Encoder:  # noqa: N802
        if not self.nvenc:
            raise PyNvVCException("NvEncoder : no NVENC on this GPU")
        if fmt != "YUV444" or not usecpuinputbuffer:
            raise PyNvVCException(f"stand-in encodes host YUV444 only, not {fmt}")
        return Encoder(int(width), int(height))


__all__ = ["Frame", "KnownPictures", "LibavPictures", "PacketData", "PyNvVCException", "PyNvVCExceptionUnsupported",
           "StandInNvc"]
