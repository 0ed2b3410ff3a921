"""The ``video`` codec: bit-exact round trips on every backend, geometry, and hostile payloads."""

from __future__ import annotations

import re
import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("av")

from vllm_kvcodec.codecs import get_codec  # noqa: E402
from vllm_kvcodec.codecs import video, video_av  # noqa: E402
from vllm_kvcodec.codecs.video_layout import (  # noqa: E402
    ALIGN,
    MAX_PLANE_HEIGHT,
    MAX_WIDTH,
    MIN_SIDE,
    from_planes,
    geometry,
    to_planes,
)
from vllm_kvcodec.codecs.dtypes import DType, tensor_to_bits  # noqa: E402
from vllm_kvcodec.errors import ChunkFormatError, CodecError, ConfigError, UnsupportedDTypeError  # noqa: E402
from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header  # noqa: E402

BACKENDS = video_av.BACKENDS
HEAD = struct.Struct("<HHIQ")


def bf16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def roundtrip(t: torch.Tensor, backend: str = "hevc") -> bytes:
    blob = encode_chunk(t, "video", backend=backend)
    out = decode_chunk(blob)
    assert same_bits(out, t), f"{backend} round trip of {tuple(t.shape)} is not bit-exact"
    return blob


def specials_bf16() -> np.ndarray:
    return np.array(
        [0x0000, 0x8000, 0x7F80, 0xFF80,  # +-0, +-Inf
         0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFF81, 0xFFAA, 0x7FA5,  # NaNs with payloads, both signs
         0x0001, 0x8001, 0x007F, 0x807F, 0x0040,  # subnormals
         0x0080, 0x8080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80],  # min normal, max finite, +-1
        dtype=np.uint16,
    )


def adversarial_bf16(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Every exponent 0..255 with random signs/mantissas, special values, and runs of equal exponents."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    exps = np.resize(np.arange(256, dtype=np.uint16), n)
    rng.shuffle(exps[: n // 2])
    raw = (exps << 7) | rng.integers(0, 128, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
    sp = specials_bf16()
    raw[: min(n, sp.size)] = sp[: min(n, sp.size)]
    if n > 64:
        raw[n // 2 : n // 2 + 32] = 0x7FC1  # a NaN run
    return raw.reshape(shape)


# ---------------------------------------------------------------- real KV


@pytest.fixture(scope="module")
def real_chunk(real_chunks: list[torch.Tensor]) -> torch.Tensor:
    return real_chunks[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_chunk_roundtrip_and_ratio(real_chunk: torch.Tensor, backend: str) -> None:
    assert tuple(real_chunk.shape) == (30, 2, 256, 3, 64)
    blob = roundtrip(real_chunk, backend)
    ratio = real_chunk.numel() * 2 / len(blob)
    assert ratio > 1.44, ratio  # measured 1.46 (hevc, h264) to 1.48 (ffv1)
    header = read_header(blob)
    assert header.codec_config == {"id": "video", "backend": backend, "layout": 1}


def test_real_chunk_fp32(real_chunk: torch.Tensor) -> None:
    t = real_chunk[:4].float().contiguous()
    t.view(torch.int32)[0, 0, :4, 0, 0] = torch.tensor([0x7FC00001, -1, 0x00000001, -(2**31)], dtype=torch.int32)
    roundtrip(t, "hevc")


def test_hevc_stream_is_one_annexb_elementary_stream(real_chunk: torch.Tensor) -> None:
    """The stream bytes alone (no size table) parse and decode as plain Annex B, as NVDEC would take them."""
    import av

    t = real_chunk[:6].contiguous()
    blob = encode_chunk(t, "video")
    h = read_header(blob)
    payload = memoryview(blob)[h.payload_offset : h.payload_offset + h.payload_length]
    width, height, frames, _ = HEAD.unpack_from(payload)
    off = HEAD.size + t.numel()
    stream = bytes(payload[off + 4 * frames :])
    assert stream[:4] == b"\x00\x00\x00\x01" and (stream[4] >> 1) & 0x3F == 32  # start code, VPS
    ctx = av.CodecContext.create("hevc", "r")
    pics = [f for pkt in [*ctx.parse(stream), *ctx.parse(None)] for f in ctx.decode(pkt)]
    pics += list(ctx.decode(None))
    assert len(pics) == frames and ctx.profile == "Rext"
    assert all((f.width, f.height, f.format.name) == (width, height, "yuv444p") for f in pics)


# ---------------------------------------------------------------- adversarial values and shapes

SHAPES = [
    (30, 2, 1, 3, 64),  # one token
    (1,),
    (7,),
    (143,),
    (145,),
    (5000,),
    (3, 5, 7),
    (1, 1, 1, 1, 1, 1, 1, 1),
    (2, 4097),  # a row wider than MAX_WIDTH: wrapped
    (1000, 1),  # row of 1: 144 rows side by side
    (2, 2, 17, 3, 48),  # row 144 exactly
    (4, 2, 33, 5, 41),  # odd row 205 -> width 208
    (1, 1, 3100, 1, 1),  # height 1040 rows -> 2 planes
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adversarial_bf16(backend: str, shape: tuple[int, ...]) -> None:
    roundtrip(bf16(adversarial_bf16(shape, seed=len(shape))), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_equal_and_single_exponent(backend: str) -> None:
    roundtrip(bf16(np.full((4, 2, 9, 3, 64), 0x3F80, dtype=np.uint16)), backend)
    roundtrip(bf16(np.zeros((30, 2, 1, 3, 64), dtype=np.uint16)), backend)
    roundtrip(bf16(np.full((300,), 0xFFC3, dtype=np.uint16)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_random_bits(backend: str) -> None:
    raw = np.random.default_rng(7).integers(0, 1 << 16, size=(3, 2, 40, 2, 64), dtype=np.uint16)
    roundtrip(bf16(raw), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_adversarial(backend: str) -> None:
    rng = np.random.default_rng(3)
    n = 3 * 700
    exps = np.resize(np.arange(256, dtype=np.uint32), n)
    raw = (exps << 23) | rng.integers(0, 1 << 23, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    raw[:8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 1, 0x807FFFFF]
    t = torch.from_numpy(raw.view(np.int32).reshape(3, 700)).view(torch.float32)
    roundtrip(t, backend)


def test_fp16_is_refused() -> None:
    with pytest.raises(UnsupportedDTypeError):
        encode_chunk(torch.zeros(4, 64, dtype=torch.float16), "video")


# ---------------------------------------------------------------- geometry


@given(st.lists(st.integers(1, 300), min_size=1, max_size=5))
@settings(max_examples=200, deadline=None)
def test_geometry_invariants(shape: list[int]) -> None:
    geo = geometry(tuple(shape))
    assert geo.width % ALIGN == 0 and geo.height % ALIGN == 0
    assert MIN_SIDE <= geo.width <= MAX_WIDTH and MIN_SIDE <= geo.height <= MAX_PLANE_HEIGHT
    assert geo.row <= geo.width < geo.row + ALIGN
    assert geo.frames >= 1 and geo.plane_rows >= geo.rows
    assert geo.frames == 1 or geo.rows > 3 * MAX_PLANE_HEIGHT * (geo.frames - 1)


def test_canonical_geometry() -> None:
    geo = geometry((30, 2, 256, 3, 64))
    assert (geo.row, geo.width, geo.height, geo.frames) == (192, 192, 1024, 5)
    assert geo.pixels == geo.n  # no padding at all on the canonical chunk
    one = geometry((30, 2, 1, 3, 64))
    assert (one.width, one.height, one.frames) == (192, 144, 1)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
@settings(max_examples=100, deadline=None)
def test_planes_roundtrip(shape: list[int], seed: int) -> None:
    geo = geometry(tuple(shape))
    exps = np.random.default_rng(seed).integers(0, 256, geo.n, dtype=np.uint8)
    planes = to_planes(exps, geo)
    assert planes.shape == (geo.frames, 3, geo.height, geo.width)
    assert np.array_equal(from_planes(planes, geo), exps)


# ---------------------------------------------------------------- property test through the codecs


@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=4).map(tuple),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([0, 2, 8, 256]),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(specials_bf16().tolist())), max_size=20),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_roundtrip(shape, backend, seed, spread, specials) -> None:
    """Exponents from constant to uniform, random sign/mantissa, special values at drawn positions."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    exps = (120 + rng.integers(0, max(spread, 1), n)) % 256 if spread < 256 else rng.integers(0, 256, n)
    raw = (exps.astype(np.uint16) << 7) | rng.integers(0, 1 << 16, n, dtype=np.uint16) & 0x807F
    for pos, value in specials:
        raw[pos % n] = value
    roundtrip(bf16(raw.reshape(shape)), backend)


# ---------------------------------------------------------------- hostile payloads


def encoded(shape=(2, 2, 20, 3, 64), backend="hevc", seed=1) -> tuple[torch.Tensor, bytes, memoryview]:
    t = bf16(adversarial_bf16(shape, seed))
    blob = encode_chunk(t, "video", backend=backend)
    h = read_header(blob)
    return t, blob, memoryview(blob)[h.payload_offset : h.payload_offset + h.payload_length]


def direct_decode(payload, backend="hevc", shape=(2, 2, 20, 3, 64), dtype=DType.BFLOAT16) -> np.ndarray:
    return video.VideoCodec(backend=backend).decode(memoryview(bytes(payload)), dtype, shape)


def stream_offset(payload: memoryview, n: int, rest: int = 1) -> tuple[int, list[int]]:
    _, _, frames, _ = HEAD.unpack_from(payload)
    off = HEAD.size + n * rest
    sizes = np.frombuffer(payload[off : off + 4 * frames], "<u4").tolist()
    return off + 4 * frames, sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_payload_truncations_raise(backend: str) -> None:
    t, blob, payload = encoded(backend=backend)
    assert np.array_equal(direct_decode(payload, backend), tensor_to_bits(t)[0])
    for cut in (0, 1, HEAD.size - 1, HEAD.size, HEAD.size + 100, len(payload) // 2, len(payload) - 1):
        with pytest.raises(CodecError):
            direct_decode(payload[:cut], backend)
    with pytest.raises(CodecError):
        direct_decode(bytes(payload) + b"\0", backend)
    for cut in (0, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(ChunkFormatError):
            decode_chunk(blob[:cut])
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x10
    with pytest.raises(ChunkFormatError):
        decode_chunk(bytes(flipped))


@pytest.mark.parametrize("field", ["width", "height", "frames", "hash"])
def test_mangled_header_raises(field: str) -> None:
    _, _, payload = encoded()
    width, height, frames, h = HEAD.unpack_from(payload)
    mangled = {"width": (width + 8, height, frames, h), "height": (width, height - 8, frames, h),
               "frames": (width, height, frames + 1, h), "hash": (width, height, frames, h ^ 1)}[field]
    with pytest.raises(CodecError):
        direct_decode(HEAD.pack(*mangled) + bytes(payload[HEAD.size :]))


def test_wrong_shape_or_dtype_raises() -> None:
    _, _, payload = encoded()
    for shape in [(2, 2, 21, 3, 64), (2, 2, 20, 3, 63), (7680,), (2, 2, 20, 3, 64, 2), (1,)]:
        with pytest.raises(CodecError):
            direct_decode(payload, shape=shape)
    with pytest.raises(CodecError):
        direct_decode(payload, dtype=DType.FLOAT32)
    with pytest.raises(CodecError):
        direct_decode(payload, dtype=DType.FLOAT16)


def test_same_geometry_other_shape_decodes_same_bits() -> None:
    # Shapes with the same element count and row width share a geometry: the payload is the same bits.
    t, _, payload = encoded()
    out = direct_decode(payload, shape=(4, 20, 3, 64))
    assert np.array_equal(out.reshape(-1), tensor_to_bits(t)[0].reshape(-1))


def test_packet_size_table_mismatch_raises() -> None:
    t, _, payload = encoded()
    at, sizes = stream_offset(payload, t.numel())
    table_at = at - 4 * len(sizes)
    for bad in ([sizes[0] + 1, *sizes[1:]], [0, *sizes[1:]], [sizes[0] - 1, *sizes[1:]], [2**32 - 1, *sizes[1:]]):
        mangled = bytes(payload[:table_at]) + np.array(bad, "<u4").tobytes() + bytes(payload[at:])
        with pytest.raises(CodecError):
            direct_decode(mangled)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_corruption_never_returns_wrong_data(backend: str) -> None:
    t, _, payload = encoded(backend=backend)
    want = tensor_to_bits(t)[0]
    at, _ = stream_offset(payload, t.numel())
    rng = np.random.default_rng(11)
    positions = sorted({at, at + 3, at + 40, *rng.integers(at, len(payload), 25).tolist(), len(payload) - 1})
    raised = 0
    for pos in positions:
        bad = bytearray(payload)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = direct_decode(bad, backend)
        except CodecError:
            raised += 1
            continue
        assert np.array_equal(out, want), f"flip at {pos - at} returned wrong data"
    assert raised > 0


def test_wrong_backend_stream_raises() -> None:
    _, _, payload = encoded(backend="hevc")
    for other in ("h264", "ffv1"):
        with pytest.raises(CodecError):
            direct_decode(payload, backend=other)


def _payload_with_pictures(t: torch.Tensor, pix_fmt: str, width: int, height: int) -> bytes:
    """A payload whose stream holds HEVC pictures of a format/size the layout never uses."""
    import av
    from fractions import Fraction

    bits, _ = tensor_to_bits(t)
    geo = geometry(tuple(t.shape))
    exps, signman = video.split(bits.reshape(-1), DType.BFLOAT16)
    ctx = av.CodecContext.create("libx265", "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = width, height, pix_fmt, Fraction(1, 25)
    ctx.options = {"preset": "ultrafast", "x265-params": "lossless=1:keyint=1:info=0:log-level=error"}
    packets = []
    for i in range(geo.frames):
        frame = av.VideoFrame(width, height, pix_fmt)
        frame.pts = i
        packets += [bytes(p) for p in ctx.encode(frame)]
    packets += [bytes(p) for p in ctx.encode(None)]
    import xxhash

    head = HEAD.pack(geo.width, geo.height, len(packets), xxhash.xxh3_64_intdigest(exps))
    return head + signman.tobytes() + np.array([len(p) for p in packets], "<u4").tobytes() + b"".join(packets)


@pytest.mark.parametrize(
    "pix_fmt, size", [("yuv420p", None), ("gray", None), ("yuv444p", (200, 144)), ("yuv444p", (192, 152))]
)
def test_wrong_picture_format_or_size_raises(pix_fmt: str, size) -> None:
    shape = (2, 2, 20, 3, 64)
    t = bf16(adversarial_bf16(shape, 1))
    geo = geometry(shape)
    width, height = size or (geo.width, geo.height)
    with pytest.raises(CodecError):
        direct_decode(_payload_with_pictures(t, pix_fmt, width, height), shape=shape)


def test_wrong_number_of_pictures_raises() -> None:
    shape = (2, 2, 300, 3, 64)  # 2400 rows: 1 picture of 800 rows x 3 planes
    t = bf16(adversarial_bf16(shape, 2))
    blob = encode_chunk(t, "video")
    h = read_header(blob)
    payload = memoryview(blob)[h.payload_offset : h.payload_offset + h.payload_length]
    at, sizes = stream_offset(payload, t.numel())
    assert len(sizes) == 1
    pkt = bytes(payload[at:])
    width, height, _, hsh = HEAD.unpack_from(payload)
    signman = bytes(payload[HEAD.size : at - 4])
    # Two pictures where one is promised (the header must agree with the shape, so frames stays 1):
    doubled = HEAD.pack(width, height, 1, hsh) + signman + struct.pack("<I", 2 * len(pkt)) + pkt + pkt
    with pytest.raises(CodecError):
        direct_decode(doubled, shape=shape)
    # A packet with only the parameter sets (VPS/SPS/PPS, no picture): decodes to zero pictures.
    first_vcl = next(m.start() for m in re.finditer(b"\x00\x00\x01", pkt) if (pkt[m.start() + 3] >> 1) & 0x3F < 32)
    headers_only = pkt[:first_vcl]  # (x265 starts slices with a 3-byte start code)
    zero = HEAD.pack(width, height, 1, hsh) + signman + struct.pack("<I", len(headers_only)) + headers_only
    with pytest.raises(CodecError, match="0 pictures, expected 1"):
        direct_decode(zero, shape=shape)


# ---------------------------------------------------------------- config, encoder safety net, missing PyAV


def test_config_validation() -> None:
    assert get_codec("video").get_config() == {"id": "video", "backend": "hevc", "layout": 1}
    assert get_codec({"id": "video", "backend": "ffv1", "layout": 1}) == get_codec("video", backend="ffv1")
    for bad in ({"backend": "vp9"}, {"layout": 2}, {"layout": True}, {"backend": "ffv1", "preset": "fast"},
                {"preset": "turbo"}, {"threads": 0}, {"threads": 1.5}, {"verify": "yes"}, {"bogus": 1}):
        with pytest.raises(ConfigError):
            get_codec("video", **bad)


def test_chunk_with_unknown_layout_is_a_format_error() -> None:
    blob = encode_chunk(torch.ones(4, 64, dtype=torch.bfloat16), "video")
    forged = blob.replace(b'"layout":1', b'"layout":9')
    import xxhash

    body = forged[:-8]
    with pytest.raises(ChunkFormatError, match="layout"):
        decode_chunk(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


def test_encoder_verify_catches_inexact_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    real = video_av.decode_pictures

    def lossy(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0, 0, 0, 0] ^= 1
        return out

    monkeypatch.setattr(video_av, "decode_pictures", lossy)
    t = torch.ones(2, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(CodecError, match="bit-exactly"):
        encode_chunk(t, "video")
    blob = encode_chunk(t, "video", verify=False)  # the decoder's checksum still refuses it
    with pytest.raises(CodecError, match="checksum"):
        decode_chunk(blob)


def test_missing_pyav_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = encode_chunk(torch.ones(4, 64, dtype=torch.bfloat16), "video")
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ConfigError, match=r"pip install 'vllm-kvcodec\[video\]'"):
        encode_chunk(torch.ones(4, 64, dtype=torch.bfloat16), "video")
    with pytest.raises(ConfigError, match=r"vllm-kvcodec\[video\]"):
        decode_chunk(blob)


def test_threads_parameter_roundtrip(real_chunk: torch.Tensor) -> None:
    t = real_chunk[:3].contiguous()
    blob = encode_chunk(t, "video", threads=2, preset="medium")
    assert same_bits(decode_chunk(blob), t)


def test_package_imports_without_pyav() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['av'] = None\n"
        "import vllm_kvcodec.codecs as c\n"
        "assert 'video' in c.codec_ids(), c.codec_ids()\n"
        "assert 'av' not in sys.modules or sys.modules['av'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- the encoder: NVENC where the GPU has one, x265 otherwise; one bitstream either way ---------------------


def test_encoder_auto_is_x265_without_nvenc_and_stores_nothing_of_it(real_chunk: torch.Tensor) -> None:
    from vllm_kvcodec.gpu import nvcodec

    if nvcodec.nvenc_usable()[0]:
        pytest.skip("this machine has NVENC: auto encodes with it (the gpu test covers that)")
    kv = real_chunk[:2].contiguous()
    auto, x265 = encode_chunk(kv, "video"), encode_chunk(kv, "video", encoder="x265")
    assert auto == x265  # the same x265 stream; the encoder is not part of the stored config
    assert read_header(auto).codec_config == {"id": "video", "backend": "hevc", "layout": 1}
    with pytest.raises(ConfigError, match="NVENC cannot encode here"):
        encode_chunk(kv, "video", encoder="nvenc")
    with pytest.raises(ConfigError, match="encoder"):
        get_codec({"id": "video", "backend": "ffv1", "encoder": "nvenc"})
    with pytest.raises(ConfigError, match="encoder"):
        get_codec({"id": "video", "encoder": "qsv"})


@pytest.mark.gpu
def test_nvenc_stream_decodes_with_libav_and_nvdec(real_chunk: torch.Tensor) -> None:
    """Where the GPU has NVENC: its stream is decoded by the CPU decoder (libav, inside encode's verify and here)
    and by NVDEC, bit-exactly; x265's stream by NVDEC too."""
    from vllm_kvcodec.format.device_chunks import decode_video_chunk_nvdec
    from vllm_kvcodec.gpu import nvcodec

    ok, reason = nvcodec.nvenc_usable()
    if not ok:
        pytest.skip(f"no NVENC here: {reason}")
    kv = real_chunk[:2].contiguous()
    for encoder in ("nvenc", "x265"):
        blob = encode_chunk(kv, "video", encoder=encoder)
        assert same_bits(decode_chunk(blob), kv)
        got = decode_video_chunk_nvdec(blob, "cuda")
        assert same_bits(got.cpu(), kv)
