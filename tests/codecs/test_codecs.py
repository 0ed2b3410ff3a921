"""Every registered codec round-trips bit-exactly: real KV, special values, random shapes."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.support.adversarial import bits_view, every_exponent, random_bits, special_values
from vllm_kvcodec.codecs import codec_ids, get_codec
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ConfigError, UnsupportedDTypeError
from vllm_kvcodec.format import decode_chunk, encode_chunk

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Every bit-exact codec. The video codec has its own suite (tests/codecs/test_codec_video.py: its encoder is slow),
# and so has the lossy one (tests/codecs/test_codec_quantized.py: what it promises is not a bit-exact round trip).
FAST_CODECS = [c for c in codec_ids() if c != "video" and get_codec(c).lossless]


def supports(codec: str, dtype: torch.dtype) -> bool:
    return get_codec(codec).supports(DType.from_torch(dtype))


def assert_round_trip(kv: torch.Tensor, codec: str) -> bytes:
    blob = encode_chunk(kv, codec)
    out = decode_chunk(blob)
    assert out.dtype == kv.dtype and out.shape == kv.shape
    assert torch.equal(bits_view(out), bits_view(kv.contiguous()))
    return blob


@pytest.mark.parametrize("codec", FAST_CODECS)
def test_real_kv_round_trip(codec: str, real_chunks: list[torch.Tensor]) -> None:
    for chunk in real_chunks:
        assert_round_trip(chunk, codec)


@pytest.mark.parametrize("codec,floor", [("splitzip", 1.32), ("rans", 1.50), ("zstd", 1.40)])
def test_real_kv_ratio(codec: str, floor: float, real_chunks: list[torch.Tensor]) -> None:
    """Ratios the papers' notes predict on real KV; a codec that stops compressing fails here."""
    raw = sum(c.numel() * 2 for c in real_chunks)
    stored = sum(len(encode_chunk(c, codec)) for c in real_chunks)
    assert raw / stored >= floor


@pytest.mark.parametrize("codec", FAST_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", [special_values, every_exponent], ids=["special", "every_exponent"])
def test_adversarial_values(codec: str, dtype: torch.dtype, make) -> None:
    if not supports(codec, dtype):
        with pytest.raises(UnsupportedDTypeError, match="cannot encode"):
            encode_chunk(make(dtype), codec)
        return
    assert_round_trip(make(dtype), codec)


@pytest.mark.parametrize(
    "codec,dtype", [(c, d) for c in FAST_CODECS for d in DTYPES if supports(c, d)], ids=str
)
def test_all_equal_and_single_token(codec: str, dtype: torch.dtype, real_chunks) -> None:
    assert_round_trip(torch.full((30, 2, 256, 3, 64), -2.5, dtype=dtype), codec)
    assert_round_trip(real_chunks[0][:, :, :1].to(dtype), codec)
    assert_round_trip(torch.zeros(1, dtype=dtype), codec)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from(FAST_CODECS),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_bits_any_shape(codec: str, dtype: torch.dtype, shape: list[int], seed: int) -> None:
    if supports(codec, dtype):
        assert_round_trip(random_bits(tuple(shape), dtype, seed), codec)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_escape_heavy_mixtures(data) -> None:
    """Few dominant exponents plus a controllable share of rare ones: escapes at every density."""
    n = data.draw(st.integers(1, 4000))
    rare = data.draw(st.floats(0, 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    common = rng.integers(110, 126, n)
    exps = np.where(rng.random(n) < rare, rng.integers(0, 256, n), common).astype(np.uint16)
    words = (rng.integers(0, 2, n).astype(np.uint16) << 15) | (exps << 7) | rng.integers(0, 128, n).astype(np.uint16)
    kv = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    for codec in ("splitzip", "rans"):
        assert_round_trip(kv, codec)


def test_registry_round_trips_configs() -> None:
    for cid in codec_ids():
        codec = get_codec(cid)
        assert get_codec(codec.get_config()) == codec
    assert get_codec("zstd", level=5).get_config() == {"id": "zstd", "level": 5}


def test_registry_rejects_unknown_codec_and_parameters() -> None:
    with pytest.raises(ConfigError, match="unknown codec 'nope'"):
        get_codec("nope")
    with pytest.raises(ConfigError, match="bad parameters"):
        get_codec("splitzip", level=3)
    with pytest.raises(ConfigError, match="zstd level"):
        get_codec("zstd", level=99)


def test_splitzip_payload_size_matches_paper_formula(real_chunks) -> None:
    """n/2 code bytes + n sign-mantissa bytes + 16 codebook + 4 count + 5 per escape."""
    from vllm_kvcodec.codecs.splitzip import SplitZipCodec

    chunk = real_chunks[1]
    bits = chunk.view(torch.int16).numpy().view(np.uint16)
    payload = SplitZipCodec().encode(bits, DType.BFLOAT16)
    n = bits.size
    escapes = (len(payload) - 20 - n - (n + 1) // 2) / 5
    assert escapes == int(escapes) and 0 <= escapes < 0.002 * n


def test_rans_token_axis_is_a_stored_parameter(real_chunks) -> None:
    """LMCache's layer-wise [tokens, 2, hidden] has its tokens first; the chunk says so."""
    t2d = real_chunks[0][0].permute(1, 0, 2, 3).reshape(256, 2, 192).contiguous()
    blob = assert_round_trip(t2d, get_codec("rans", token_axis=0))
    from vllm_kvcodec.format import read_header

    assert read_header(blob).codec_config == {"id": "rans", "token_axis": 0}
    assert len(blob) < len(encode_chunk(t2d, "rans"))  # the right axis compresses better
    with pytest.raises(ConfigError, match="token_axis"):
        get_codec("rans", token_axis=-1)
