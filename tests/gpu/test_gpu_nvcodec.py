"""NVDEC path of the video codec (vllm_kvcodec/gpu/nvcodec.py), as far as a CPU can check it.

No NVIDIA driver here: PyNvVideoCodec must be reported unavailable with a
reason, never raise at import. The code after the decoder (payload parsing,
cropping, joining, the exponent checksum) runs on CPU tensors with libav
decoding the same HEVC stream in NVDEC's place.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from vllm_kvcodec.errors import CodecError, ConfigError
from vllm_kvcodec.gpu import nvcodec


@pytest.fixture
def no_pynvvideocodec(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)  # makes the import raise ImportError
    nvcodec._reset_import_cache()
    yield
    nvcodec._reset_import_cache()


def test_unavailable_is_a_reason_not_an_exception(no_pynvvideocodec) -> None:
    ok, reason = nvcodec.nvdec_available()
    assert ok is False and "PyNvVideoCodec is not importable" in reason
    ok, reason_enc = nvcodec.nvenc_available()
    assert ok is False and reason_enc == reason
    with pytest.raises(nvcodec.NvCodecUnavailable, match="PyNvVideoCodec is not importable"):
        nvcodec.nvdec_decode_planes(b"\0\0\0\1", 144, 144, 1, packet_sizes=[4])
    with pytest.raises(nvcodec.NvCodecUnavailable):
        nvcodec.nvenc_encode_planes(np.zeros((1, 3, 144, 144), dtype=np.uint8))
    assert issubclass(nvcodec.NvCodecUnavailable, ConfigError)


def test_available_here_matches_reality() -> None:
    nvcodec._reset_import_cache()
    ok, reason = nvcodec.nvdec_available()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if not torch.cuda.is_available():
        assert ok is False


def test_payload_header_matches_the_video_codec() -> None:
    video = pytest.importorskip("vllm_kvcodec.codecs.video")
    assert nvcodec.VIDEO_HEAD.format == video._HEAD.format


@pytest.fixture(scope="module")
def video_chunk(real_kv_1k: torch.Tensor):
    pytest.importorskip("av")
    from vllm_kvcodec.format import encode_chunk

    kv = real_kv_1k[:, :, :52].contiguous()  # 3120 rows of 192 exponents: 2 pictures of 192 x 520
    return kv, encode_chunk(kv, "video")


def _libav_planes(stream: bytes, width: int, height: int, frames: int, device: torch.device) -> torch.Tensor:
    """Stand-in for NVDEC: libav decodes the same elementary stream (split at its packet sizes)."""
    from vllm_kvcodec.codecs import video_av

    sizes = _libav_planes.sizes
    packets, at = [], 0
    for s in sizes:
        packets.append(memoryview(stream)[at : at + s])
        at += s
    planes = video_av.decode_pictures(packets, "hevc", width, height)
    return torch.from_numpy(planes).to(device)


def _payload(blob: bytes) -> tuple[memoryview, tuple[int, ...]]:
    from vllm_kvcodec.format import read_header

    h = read_header(blob)
    return memoryview(blob)[h.payload_offset : h.payload_offset + h.payload_length], h.shape


def test_stream_is_annex_b_hevc(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    parsed = nvcodec.parse_video_payload(payload, shape)
    assert (parsed.width, parsed.height, parsed.frames) == (192, 520, 2)
    stream = bytes(parsed.stream)
    assert stream.startswith(nvcodec.ANNEXB_START)
    assert (stream[4] >> 1) & 0x3F == 32  # the first NAL unit is a VPS
    assert sum(parsed.packet_sizes) == len(stream) and len(parsed.packet_sizes) == parsed.frames


def test_gpu_side_of_the_decode_is_bit_exact(video_chunk) -> None:
    kv, blob = video_chunk
    payload, shape = _payload(blob)
    _libav_planes.sizes = nvcodec.parse_video_payload(payload, shape).packet_sizes
    got = nvcodec.decode_video_chunk_nvdec(blob, "cpu", planes_decoder=_libav_planes)
    assert got.dtype == torch.bfloat16 and got.shape == kv.shape
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))


def test_exponent_checksum_catches_a_wrong_picture(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    _libav_planes.sizes = nvcodec.parse_video_payload(payload, shape).packet_sizes

    def corrupt(*args):
        planes = _libav_planes(*args).clone()
        planes[0, 0, 0, 0] ^= 1
        return planes

    with pytest.raises(CodecError, match="checksum"):
        nvcodec.decode_video_chunk_nvdec(blob, "cpu", planes_decoder=corrupt)


def test_payload_validation(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    with pytest.raises(CodecError):
        nvcodec.parse_video_payload(payload[:-1], shape)
    with pytest.raises(CodecError):
        nvcodec.parse_video_payload(payload, (shape[0] + 1, *shape[1:]))
    with pytest.raises(CodecError):
        nvcodec.parse_video_payload(payload[:10], shape)


def test_only_hevc_video_chunks(real_kv_1k: torch.Tensor) -> None:
    from vllm_kvcodec.format import encode_chunk

    blob = encode_chunk(real_kv_1k[:1, :, :4].contiguous(), "splitzip")
    with pytest.raises(ConfigError, match="hevc"):
        nvcodec.decode_video_chunk_nvdec(blob, "cpu")


def test_needs_the_library_for_the_real_decoder(video_chunk, no_pynvvideocodec) -> None:
    _, blob = video_chunk
    with pytest.raises(nvcodec.NvCodecUnavailable):
        nvcodec.decode_video_chunk_nvdec(blob, "cuda")


class _FakeFrame:
    """What a PyNvVideoCodec frame offers: DLPack (and a pixel format)."""

    def __init__(self, t: torch.Tensor, fmt: str = "Pixel_Format.YUV444") -> None:
        self.t, self.format = t, fmt

    def __dlpack__(self, *args, **kwargs):
        return self.t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@pytest.mark.parametrize("layout", ["stacked_2d", "planar_3d", "pitched"])
def test_frame_planes_layouts(layout: str) -> None:
    h, w = 144, 152
    planes = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
    if layout == "stacked_2d":
        t = planes.reshape(3 * h, w)
    elif layout == "planar_3d":
        t = planes
    else:  # rows padded to a 256-byte pitch
        t = torch.zeros(3 * h, 256, dtype=torch.uint8)
        t[:, :w] = planes.reshape(3 * h, w)
    got = nvcodec._frame_planes(_FakeFrame(t), w, h, torch.device("cpu"))
    assert torch.equal(got, planes)


def test_frame_planes_refuses_420() -> None:
    t = torch.zeros(216, 144, dtype=torch.uint8)
    with pytest.raises(nvcodec.NvCodecUnavailable, match="4:4:4"):
        nvcodec._frame_planes(_FakeFrame(t, "Pixel_Format.NV12"), 144, 144, torch.device("cpu"))


# ---- NvdecSession against the calls PyNvVideoCodec 2.0.4 offers (libav behind them) ---------------------------

#: CreateDecoder's keywords in 2.0.4 (its pybind signature and docstring; 2.2.4 has the same).
CREATE_DECODER_2_0_4 = {"gpuid", "codec", "cudacontext", "cudastream", "usedevicememory", "enableasyncallocations",
                        "maxwidth", "maxheight", "outputColorType", "enableSEIMessage", "bWaitForSessionWarmUp",
                        "latency", "enableDecodeStats"}


class _Enum:
    def __init__(self, *names: str) -> None:
        for name in names:
            setattr(self, name, f"<{name}>")


class _PacketData:
    """2.0.4's PacketData: these read-write fields and no others."""

    __slots__ = ("key", "pts", "dts", "pos", "bsl", "bsl_data", "duration", "decode_flag", "stream_index",
                 "is_video", "discardable", "seek_pts", "bDiscontinuity")


class _Decoder:
    """Decode(PacketData) -> [frames]; one libav HEVC decoder reused across streams, as a session reuses NVDEC."""

    def __init__(self) -> None:
        import av

        self.ctx = av.CodecContext.create("hevc", "r")
        self.calls = 0

    def Decode(self, packet: _PacketData) -> list:  # noqa: N802 - PyNvVideoCodec's name
        import ctypes

        import av

        assert packet.decode_flag == "<ENDOFPICTURE>"
        self.calls += 1
        data = ctypes.string_at(packet.bsl_data, packet.bsl)
        frames = []
        for f in self.ctx.decode(av.Packet(data)):
            planes = np.stack([np.frombuffer(f.planes[p], np.uint8).reshape(f.height, -1)[:, : f.width] for p in range(3)])
            frames.append(_FakeFrame(torch.from_numpy(planes.reshape(3 * f.height, f.width).copy())))
        return frames


class _FakeNvc:
    """The part of PyNvVideoCodec 2.0.4 that vllm_kvcodec may call; anything else is an AttributeError."""

    cudaVideoCodec = _Enum("HEVC", "H264", "MPEG2")
    cudaVideoChromaFormat = _Enum("YUV420", "YUV444")
    DisplayDecodeLatencyType = _Enum("NATIVE", "LOW", "ZERO")
    VideoPacketFlag = _Enum("ENDOFSTREAM", "ENDOFPICTURE")
    PacketData = _PacketData

    def __init__(self) -> None:
        self.decoders: list[_Decoder] = []

    def CreateDecoder(self, **kwargs):  # noqa: N802
        unknown = set(kwargs) - CREATE_DECODER_2_0_4
        assert not unknown, f"not a 2.0.4 CreateDecoder keyword: {unknown}"
        assert kwargs["usedevicememory"] is True and kwargs["latency"] == "<ZERO>" and kwargs["codec"] == "<HEVC>"
        self.decoders.append(_Decoder())
        return self.decoders[-1]

    def GetDecoderCaps(self, **kwargs):  # noqa: N802
        assert set(kwargs) == {"gpuid", "codec", "chromaformat", "bitdepth"}
        return {"num_decoder_engines": 7}


def test_session_uses_only_2_0_4_calls_and_is_reused(real_kv_1k: torch.Tensor) -> None:
    pytest.importorskip("av")
    from vllm_kvcodec.format import encode_chunk
    from vllm_kvcodec.gpu.nvdec_sessions import NvdecSession, nvdec_engines

    nvc = _FakeNvc()
    session = NvdecSession(torch.device("cpu"), nvc)
    for tokens in (52, 20, 52):  # three streams, two picture sizes, one decoder
        kv = real_kv_1k[:, :, :tokens].contiguous()
        blob = encode_chunk(kv, "video")
        got = nvcodec.decode_video_chunk_nvdec(blob, "cpu", session=session)
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
    assert len(nvc.decoders) == 1 and session.streams_decoded == 3
    assert nvdec_engines(torch.device("cpu"), nvc) == 7


def test_session_refuses_a_stream_that_gives_no_picture(video_chunk) -> None:
    """A packet that holds no picture (here: only the stream's VPS): an error, never a missing picture."""
    from vllm_kvcodec.gpu.nvdec_sessions import NvdecSession

    _, blob = video_chunk
    payload, shape = _payload(blob)
    parsed = nvcodec.parse_video_payload(payload, shape)
    session = NvdecSession(torch.device("cpu"), _FakeNvc())
    out = torch.empty((parsed.frames, 3, parsed.height, parsed.width), dtype=torch.uint8)
    packets = nvcodec.split_packets(parsed.stream, parsed.packet_sizes)
    with pytest.raises(CodecError, match="decode|pictures"):
        first = bytes(packets[0])
        vps_only = first[: first.index(nvcodec.ANNEXB_START, 4)]
        session.decode_into([memoryview(vps_only)], parsed.width, parsed.height, out[:1])


def test_session_pool_bounds_reuses_and_replaces_failed_sessions() -> None:
    """At most ``size`` sessions; a session whose decode raised is dropped, and a thread waiting meanwhile makes
    the replacement instead of waiting forever."""
    import threading

    from vllm_kvcodec.gpu.nvdec_sessions import SessionPool

    class Session:
        def __init__(self) -> None:
            self.closed = False

        def close(self) -> None:
            self.closed = True

    pool = SessionPool(Session, 1)
    with pool.take() as a:
        pass
    with pool.take() as b:
        assert b is a  # reused
    got: list[object] = []
    entered, release = threading.Event(), threading.Event()

    def failing() -> None:
        with pytest.raises(CodecError), pool.take():
            entered.set()
            release.wait(5)
            raise CodecError("damaged stream")

    t1 = threading.Thread(target=failing)
    t1.start()
    assert entered.wait(5)
    held = pool.take()  # kept: a collected context manager would give its session back
    t2 = threading.Thread(target=lambda: got.append(held.__enter__()))
    t2.start()  # waits: the only session is taken
    release.set()
    t1.join(5)
    t2.join(5)
    assert not t2.is_alive() and got and got[0] is not a and a.closed
    assert pool.created == 2 and pool.live == 1


@pytest.mark.parametrize("tokens", [1, 52, 256])
def test_access_units_are_the_payloads_packets(real_kv_1k: torch.Tensor, tokens: int) -> None:
    """A stream without its packet table (NVENC's, say) is cut where the video payload's packets are."""
    pytest.importorskip("av")
    from vllm_kvcodec.format import encode_chunk

    blob = encode_chunk(real_kv_1k[:, :, :tokens].contiguous(), "video")
    payload, shape = _payload(blob)
    parsed = nvcodec.parse_video_payload(payload, shape)
    units = nvcodec.access_units(parsed.stream)
    assert [len(u) for u in units] == list(parsed.packet_sizes)
    session = __import__("vllm_kvcodec.gpu.nvdec_sessions", fromlist=["x"]).NvdecSession(torch.device("cpu"), _FakeNvc())
    planes = nvcodec.nvdec_decode_planes(parsed.stream, parsed.width, parsed.height, parsed.frames, "cpu", session=session)
    assert torch.equal(nvcodec.planes_to_exponents(planes, parsed.geometry),
                       ((real_kv_1k[:, :, :tokens].contiguous().view(torch.int16).view(-1) >> 7) & 0xFF).to(torch.uint8))
