"""NVDEC/NVENC path of the video codec (gpu/nvcodec.py, gpu/nvdec_sessions.py, format/device_chunks.py) on a CPU.

No NVIDIA driver here: PyNvVideoCodec must be reported unavailable with a
reason, never raise at import. The code after the decoder (payload parsing,
cropping, joining, the exponent checksum) runs on CPU tensors with libav
decoding the same HEVC stream in NVDEC's place, and the sessions run against
:mod:`vllm_kvcodec.tools.gpu_nvc_stand_in`, a stand-in of PyNvVideoCodec
2.0.4 that behaves as its wheel does (enum names, one picture size per
decoder, frame buffers reused by the next Decode, its exception types,
NVENC's list-of-dicts packets), so these tests fail where a device would.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from vllm_kvcodec.format import device_chunks
from vllm_kvcodec.errors import CodecError, ConfigError
from vllm_kvcodec.gpu import nvcodec, nvdec_sessions
from vllm_kvcodec.gpu.nvdec_sessions import NvdecSession, NvdecSessions, SessionPool, decoder_caps, nvdec_engines
from vllm_kvcodec.tools.gpu_nvc_stand_in import KnownPictures, PacketData, PyNvVCException, PyNvVCExceptionUnsupported, StandInNvc


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
        nvdec_sessions.nvdec_decode_planes(b"\0\0\0\1", 144, 144, 1, packet_sizes=[4])
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
    assert device_chunks.VIDEO_HEAD.format == video._HEAD.format


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
    parsed = device_chunks.parse_video_payload(payload, shape)
    assert (parsed.width, parsed.height, parsed.frames) == (192, 520, 2)
    stream = bytes(parsed.stream)
    assert stream.startswith(nvcodec.ANNEXB_START)
    assert (stream[4] >> 1) & 0x3F == 32  # the first NAL unit is a VPS
    assert sum(parsed.packet_sizes) == len(stream) and len(parsed.packet_sizes) == parsed.frames


def test_gpu_side_of_the_decode_is_bit_exact(video_chunk) -> None:
    kv, blob = video_chunk
    payload, shape = _payload(blob)
    _libav_planes.sizes = device_chunks.parse_video_payload(payload, shape).packet_sizes
    got = device_chunks.decode_video_chunk_nvdec(blob, "cpu", planes_decoder=_libav_planes)
    assert got.dtype == torch.bfloat16 and got.shape == kv.shape
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))


def test_exponent_checksum_catches_a_wrong_picture(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    _libav_planes.sizes = device_chunks.parse_video_payload(payload, shape).packet_sizes

    def corrupt(*args):
        planes = _libav_planes(*args).clone()
        planes[0, 0, 0, 0] ^= 1
        return planes

    with pytest.raises(CodecError, match="checksum"):
        device_chunks.decode_video_chunk_nvdec(blob, "cpu", planes_decoder=corrupt)


def test_payload_validation(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    with pytest.raises(CodecError):
        device_chunks.parse_video_payload(payload[:-1], shape)
    with pytest.raises(CodecError):
        device_chunks.parse_video_payload(payload, (shape[0] + 1, *shape[1:]))
    with pytest.raises(CodecError):
        device_chunks.parse_video_payload(payload[:10], shape)


def test_only_hevc_video_chunks(real_kv_1k: torch.Tensor) -> None:
    from vllm_kvcodec.format import encode_chunk

    blob = encode_chunk(real_kv_1k[:1, :, :4].contiguous(), "splitzip")
    with pytest.raises(ConfigError, match="hevc"):
        device_chunks.decode_video_chunk_nvdec(blob, "cpu")


def test_needs_the_library_for_the_real_decoder(video_chunk, no_pynvvideocodec) -> None:
    _, blob = video_chunk
    with pytest.raises(nvcodec.NvCodecUnavailable):
        device_chunks.decode_video_chunk_nvdec(blob, "cuda")


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



# ---- the stand-in behaves as PyNvVideoCodec 2.0.4 does (issue 43, item 9) ---------------------------------------


def _packet(data: bytes, nvc: StandInNvc) -> tuple[PacketData, np.ndarray]:
    buf = np.frombuffer(data, dtype=np.uint8)
    packet = PacketData()
    packet.bsl_data, packet.bsl, packet.decode_flag = buf.ctypes.data, buf.size, nvc.VideoPacketFlag.ENDOFPICTURE
    return packet, buf


def _one_picture_stream(real_kv_1k: torch.Tensor, tokens: int) -> tuple[bytes, np.ndarray]:
    """A one-picture HEVC packet of real exponents and the picture it holds ([3, h, w])."""
    from vllm_kvcodec.codecs import video_av
    from vllm_kvcodec.codecs.video_layout import geometry, to_planes

    kv = real_kv_1k[:2, :, :tokens].contiguous()
    exps = ((kv.view(torch.int16).view(-1).numpy().view("<u2") >> 7) & 0xFF).astype("u1")
    geo = geometry(tuple(kv.shape))
    planes = to_planes(exps, geo)[:1]
    (packet,) = video_av.encode_pictures(planes, "hevc", None, 1)
    return bytes(packet), planes[0]


def test_stand_in_has_the_real_enum_names_and_caps_dict() -> None:
    nvc = StandInNvc()
    assert not hasattr(nvc.cudaVideoChromaFormat, "YUV444")
    assert sorted(nvc.cudaVideoChromaFormat.__members__) == ["420", "422", "444", "Monochrome"]
    caps = nvc.GetDecoderCaps(gpuid=0, codec=nvc.cudaVideoCodec.HEVC,
                              chromaformat=getattr(nvc.cudaVideoChromaFormat, "444"), bitdepth=8)
    assert isinstance(caps, dict) and caps["supported"] == 1 and caps["num_decoder_engines"] == 7


def test_stand_in_decoder_is_sized_by_its_first_picture_and_reuses_its_frame_buffer(real_kv_1k) -> None:
    pytest.importorskip("av")
    big, big_picture = _one_picture_stream(real_kv_1k, 200)  # 192 x 272
    small, small_picture = _one_picture_stream(real_kv_1k, 20)  # 192 x 144
    nvc = StandInNvc()
    dec = nvc.CreateDecoder(gpuid=0, codec=nvc.cudaVideoCodec.HEVC, usedevicememory=True,
                            latency=nvc.DisplayDecodeLatencyType.ZERO)
    (first,) = dec.Decode(_packet(big, nvc)[0])
    view = torch.from_dlpack(first)
    assert torch.equal(view.reshape(big_picture.shape), torch.from_numpy(big_picture))
    (second,) = dec.Decode(_packet(small, nvc)[0])  # a smaller picture: scaled to the first size
    assert tuple(torch.from_dlpack(second).shape) == (3 * 272, 192)
    assert not torch.equal(view.reshape(big_picture.shape), torch.from_numpy(big_picture))  # overwritten in place
    dec = nvc.CreateDecoder(gpuid=0, codec=nvc.cudaVideoCodec.HEVC, maxwidth=192, maxheight=144)
    dec.Decode(_packet(small, nvc)[0])
    with pytest.raises(PyNvVCException, match="Reconfigure Not supported when width/height > maxwidth/maxheight"):
        dec.Decode(_packet(big, nvc)[0])
    with pytest.raises(PyNvVCExceptionUnsupported):
        StandInNvc(unsupported=True).CreateDecoder(codec=nvc.cudaVideoCodec.HEVC).Decode(_packet(small, nvc)[0])


# ---- sessions: one per picture size, sized pool, real caps member (items 1, 3, 6, 8) ------------------------------


def test_caps_query_uses_the_real_4_4_4_member() -> None:
    """2.0.4 has no cudaVideoChromaFormat.YUV444: the caps come from GetDecoderCaps with member '444', not a table."""
    nvc = StandInNvc(engines=5, max_size=(4096, 2304))
    caps = decoder_caps(torch.device("cpu"), nvc)
    assert caps["source"] == "GetDecoderCaps" and caps["supported"] is True
    assert (caps["engines"], caps["width_max"], caps["height_max"], caps["width_min"]) == (5, 4096, 2304, 144)
    assert nvdec_engines(torch.device("cpu"), nvc) == 5


@pytest.mark.parametrize("tokens", [(52, 20, 52, 80, 20)])
def test_sessions_are_per_picture_size_and_reused(real_kv_1k: torch.Tensor, tokens) -> None:
    """Full chunks and tails have pictures of different heights: each size gets its own decoder, made with that
    size as its maximum, reused for that size only; every chunk bit-exact."""
    pytest.importorskip("av")
    from vllm_kvcodec.format import encode_chunk

    nvc = StandInNvc()
    pool = SessionPool(lambda: NvdecSession(torch.device("cpu"), nvc), 4)
    for t in tokens:
        kv = real_kv_1k[:, :, :t].contiguous()
        got = device_chunks.decode_video_chunk_nvdec(encode_chunk(kv, "video"), "cpu", session=pool)
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16)), t
    sizes = {(c["maxwidth"], c["maxheight"]) for c in nvc.create_calls}
    assert len(nvc.decoders) == pool.created == len(sizes) == 3 and pool.evicted == 0
    assert all(c["usedevicememory"] is True and c["latency"] is nvc.DisplayDecodeLatencyType.ZERO for c in nvc.create_calls)


def _parsed_and_out(video_chunk) -> tuple:
    """The fixture chunk's parsed payload and a picture buffer for it."""
    payload, shape = _payload(video_chunk[1])
    parsed = device_chunks.parse_video_payload(payload, shape)
    return parsed, torch.empty((parsed.frames, 3, parsed.height, parsed.width), dtype=torch.uint8)


def test_a_session_refuses_another_picture_size(video_chunk) -> None:
    parsed, out = _parsed_and_out(video_chunk)
    session = NvdecSession(torch.device("cpu"), StandInNvc())
    session.decode_into(parsed.packets(), parsed.width, parsed.height, out)
    with pytest.raises(ValueError, match="handed"):
        session.decode_into(parsed.packets(), parsed.width, parsed.height + 8, out)


def test_pool_makes_room_from_the_least_recently_used_idle_size() -> None:
    made: list[object] = []

    class Session:
        closed = False

        def close(self) -> None:
            self.closed = True

    pool = SessionPool(lambda: made.append(Session()) or made[-1], 2)
    for key in ("a", "b", "a", "c", "b"):
        with pool.take(key):
            pass
    assert pool.created == 4 and pool.evicted == 2 and pool.live == 2  # c evicts b (LRU), b then evicts a
    assert [s.closed for s in made] == [True, True, False, False]


def test_unsupported_is_unavailability_not_damage(video_chunk) -> None:
    """PyNvVCExceptionUnsupported during Decode turns NVDEC off (NvCodecUnavailable); PyNvVCException is damage."""
    parsed, out = _parsed_and_out(video_chunk)
    with pytest.raises(nvcodec.NvCodecUnavailable, match="PyNvVCExceptionUnsupported"):
        NvdecSession(torch.device("cpu"), StandInNvc(unsupported=True)).decode_into(
            parsed.packets(), parsed.width, parsed.height, out)
    with pytest.raises(nvcodec.NvCodecUnavailable, match="outside this GPU"):
        NvdecSession(torch.device("cpu"), StandInNvc(max_size=(4096, 160))).decode_into(
            parsed.packets(), parsed.width, parsed.height, out)
    unparsable = StandInNvc(pictures=lambda: KnownPictures({}))  # every packet raises PyNvVCException
    with pytest.raises(CodecError, match="PyNvVCException"):
        NvdecSession(torch.device("cpu"), unparsable).decode_into(parsed.packets(), parsed.width, parsed.height, out)


def test_session_refuses_a_stream_that_gives_no_picture(video_chunk) -> None:
    """A packet that holds no picture (here: only the stream's VPS): an error, never a missing picture."""
    parsed, out = _parsed_and_out(video_chunk)
    session = NvdecSession(torch.device("cpu"), StandInNvc())
    first = bytes(parsed.packets()[0])
    vps_only = first[: first.index(nvcodec.ANNEXB_START, 4)]
    with pytest.raises(CodecError, match="decode|pictures"):
        session.decode_into([memoryview(vps_only)], parsed.width, parsed.height, out[:1])


def test_session_pool_bounds_reuses_and_replaces_failed_sessions() -> None:
    """At most ``size`` sessions; a session whose decode raised is dropped, and a thread waiting meanwhile makes
    the replacement instead of waiting forever."""
    import threading

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
    parsed = device_chunks.parse_video_payload(payload, shape)
    units = nvcodec.access_units(parsed.stream)
    assert [len(u) for u in units] == list(parsed.packet_sizes)
    session = NvdecSessions(StandInNvc())(torch.device("cpu"))
    planes = nvdec_sessions.nvdec_decode_planes(parsed.stream, parsed.width, parsed.height, parsed.frames, "cpu", session=session)
    assert torch.equal(nvcodec.planes_to_exponents(planes, parsed.geometry),
                       ((real_kv_1k[:, :, :tokens].contiguous().view(torch.int16).view(-1) >> 7) & 0xFF).to(torch.uint8))


# ---- NVENC returns lists of dicts (item 7) ---------------------------------------------------------------------


@pytest.fixture
def stand_in_library(monkeypatch: pytest.MonkeyPatch):
    """Make ``nvcodec`` find the stand-in as its PyNvVideoCodec."""
    def install(nvc: StandInNvc) -> StandInNvc:
        monkeypatch.setattr(nvcodec, "_NVC", nvc)
        return nvc

    yield install
    nvcodec._reset_import_cache()


def test_nvenc_packets_are_read_from_lists_of_dicts(real_kv_1k: torch.Tensor, stand_in_library) -> None:
    """2.0.4's Encode/EndEncode return [{'data': bytes, ...}] (empty while NVENC holds a picture back): one packet
    per picture comes out, and libav decodes them to the same pictures."""
    pytest.importorskip("av")
    from vllm_kvcodec.codecs import video_av
    from vllm_kvcodec.codecs.video_layout import geometry, to_planes

    stand_in_library(StandInNvc(nvenc=True))
    kv = real_kv_1k[:, :, :60].contiguous()
    exps = ((kv.view(torch.int16).view(-1).numpy().view("<u2") >> 7) & 0xFF).astype("u1")
    geo = geometry(tuple(kv.shape))
    planes = to_planes(exps, geo)
    packets = nvcodec.nvenc_encode_pictures(planes)
    assert len(packets) == geo.frames > 1 and all(isinstance(p, bytes) and p for p in packets)
    back = video_av.decode_pictures([memoryview(p) for p in packets], "hevc", geo.width, geo.height)
    assert np.array_equal(back, planes)
    assert nvcodec.encoded_packets([{"data": b"", "timestamp": 0, "picture_type": 0}]) == []


# ---- PyNvVideoCodec's __init__ needs NVENC's library; its decoder module does not (item 4) ------------------------


@pytest.fixture
def package_without_nvenc(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A PyNvVideoCodec whose __init__ fails as 2.0.4's does without libnvidia-encode, beside a native decoder module
    (a source file standing in for PyNvVideoCodec_130.cpython-*.so)."""
    pkg = tmp_path / "PyNvVideoCodec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise RuntimeError("libnvidia-encode.so.1: cannot open shared object file")\n')
    (pkg / "PyNvVideoCodec_130.py").write_text("MARK = 'the decoder module, loaded by path'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "PyNvVideoCodec", raising=False)
    monkeypatch.setattr(nvcodec, "DECODER_SUFFIXES", (".py",))
    nvcodec._reset_import_cache()
    yield
    nvcodec._reset_import_cache()


def test_decoder_module_loads_where_only_the_encoder_library_is_missing(package_without_nvenc, monkeypatch) -> None:
    monkeypatch.setattr(nvcodec, "have_library", lambda name: name == nvcodec.NVCUVID)
    assert nvcodec.import_nvc().MARK == "the decoder module, loaded by path"


def test_without_either_video_library_nvdec_is_unavailable(package_without_nvenc, monkeypatch) -> None:
    monkeypatch.setattr(nvcodec, "have_library", lambda name: False)
    with pytest.raises(nvcodec.NvCodecUnavailable, match="libnvidia-encode"):
        nvcodec.import_nvc()
