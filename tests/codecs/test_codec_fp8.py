"""fp8 KV chunks: the 1-byte formats through the chunk format and the codecs that hold them.

vLLM's fp8 caches hold bytes its kernel quantised; a chunk carries them as
they are (dtype codes 4, 5). ``raw`` and ``zstd`` hold any bytes; the exponent
codecs (``splitzip``, ``rans``, ``video``) are built for 8-bit exponent fields
and refuse fp8 by name, at start-up for the connector. The realistic fp8 KV
here is SmolLM2's real KV through vLLM-CPU's own quantiser (its torch port,
checked against vLLM's op where the op runs fp8).
"""

from __future__ import annotations


import pytest
import torch

from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.policy import FLOAT8_DEFAULT, auto_candidates, codec_for, default_codec_for
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ChunkFormatError, UnsupportedDTypeError
from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header
from vllm_kvcodec.tools.fp8_quant import quantize

FP8 = {torch.float8_e4m3fn: DType.FLOAT8_E4M3, torch.float8_e5m2: DType.FLOAT8_E5M2}
IDS = ["e4m3", "e5m2"]


@pytest.fixture(scope="module")
def fp8_chunks(real_kv_1k) -> dict[torch.dtype, list[torch.Tensor]]:
    """Four 256-token chunks of real KV per fp8 format, as vLLM-CPU's write op quantises it (scale 1.0)."""
    return {dt: [c.contiguous() for c in quantize(real_kv_1k, dt).split(256, dim=2)] for dt in FP8}


def every_byte(dtype: torch.dtype) -> torch.Tensor:
    """All 256 bytes (NaNs, infinities, -0, subnormals), three times, shuffled."""
    return torch.arange(256, dtype=torch.int16).to(torch.uint8).repeat(3)[torch.randperm(768)].view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(FP8), ids=IDS)
@pytest.mark.parametrize("codec", ["raw", "zstd", FLOAT8_DEFAULT, None])
def test_every_byte_round_trips(dtype, codec) -> None:
    kv = every_byte(dtype)
    blob = encode_chunk(kv, codec)
    assert same_bytes(decode_chunk(blob), kv)
    header = read_header(blob)
    assert header.dtype is FP8[dtype] and blob[6] == int(FP8[dtype]) and header.version == 1
    assert header.raw_nbytes == kv.numel()


@pytest.mark.parametrize("dtype", list(FP8), ids=IDS)
def test_real_fp8_kv_round_trips_and_compresses(dtype, fp8_chunks) -> None:
    """zstd-3, the fp8 default: 1.208x (e4m3) / 1.405x (e5m2) on these chunks, as on the engine's own fp8 KV."""
    chunks = fp8_chunks[dtype]
    raw = sum(c.numel() for c in chunks)
    stored = {}
    for spec in ("raw", {"id": "zstd", "level": 1}, FLOAT8_DEFAULT):
        blobs = [encode_chunk(c, spec) for c in chunks]
        assert all(same_bytes(decode_chunk(b), c) for b, c in zip(blobs, chunks))
        stored[str(spec)] = sum(len(b) for b in blobs)
    assert raw / stored[str(FLOAT8_DEFAULT)] >= (1.18 if dtype == torch.float8_e4m3fn else 1.37)
    assert stored[str(FLOAT8_DEFAULT)] < stored[str({"id": "zstd", "level": 1})] < stored["raw"]


@pytest.mark.parametrize("dtype", list(FP8), ids=IDS)
def test_policy_for_fp8(dtype) -> None:
    d = FP8[dtype]
    assert default_codec_for(d) == {"id": "zstd", "level": 3}
    assert codec_for(None, d, "error")[0].get_config() == {"id": "zstd", "level": 3}
    assert [get_codec(c).codec_id for c in auto_candidates(d)] == ["raw", "zstd"]
    assert "splitzip" in auto_candidates(DType.BFLOAT16) and "splitzip" not in auto_candidates(DType.FLOAT16)


@pytest.mark.parametrize("dtype", list(FP8), ids=IDS)
@pytest.mark.parametrize("codec", ["splitzip", "rans", "video"])
def test_exponent_codecs_refuse_fp8_by_name(dtype, codec) -> None:
    name = FP8[dtype].name.lower()
    with pytest.raises(UnsupportedDTypeError, match=f"cannot encode {name} bit-exactly.*'raw' or 'zstd'"):
        encode_chunk(every_byte(dtype), codec)
    with pytest.raises(UnsupportedDTypeError, match=f"cannot encode {name}"):
        codec_for(codec, FP8[dtype], "error")  # the connector's start-up check


def test_a_reader_never_decodes_fp8_bytes_as_another_format() -> None:
    """The dtype code decides the element type: a forged code is an error or the other fp8 format, never bf16 data."""
    from tests.format.test_format import reseal

    blob = bytearray(encode_chunk(every_byte(torch.float8_e4m3fn), "raw"))
    blob[6] = int(DType.BFLOAT16)  # 768 bytes are not 768 bf16 values
    with pytest.raises(ChunkFormatError, match="raw payload"):
        decode_chunk(reseal(blob))
    blob[6] = 6  # a code this reader does not know (what a reader before fp8 saw for 4 and 5)
    with pytest.raises(ChunkFormatError, match="unknown dtype code 6"):
        decode_chunk(reseal(blob))
    blob[6] = int(DType.FLOAT8_E5M2)
    assert decode_chunk(reseal(blob)).dtype == torch.float8_e5m2


def test_dtype_names() -> None:
    assert DType.parse("fp8") is DType.parse("fp8_e4m3") is DType.parse(torch.float8_e4m3fn) is DType.FLOAT8_E4M3
    assert DType.parse("fp8_e5m2") is DType.FLOAT8_E5M2
    assert DType.FLOAT8_E4M3.itemsize == 1 and DType.FLOAT8_E4M3.exponent_bits == 4
    assert DType.FLOAT8_E5M2.exponent_bits == 5 and DType.FLOAT8_E5M2.is_float8 and not DType.BFLOAT16.is_float8
    with pytest.raises(UnsupportedDTypeError):
        DType.parse("fp8_e4m3fnuz")  # ROCm's other E4M3 (bias 8): other values for the same bytes


def test_quantiser_port_matches_vllms_op_where_it_runs() -> None:
    """The port that makes the realistic fp8 KV above is vLLM's own quantiser, byte for byte."""
    from tests.paged.test_paged_layouts import op_writes_fp8
    from vllm_kvcodec.paged.cpu_attn import vllm_write

    if why := op_writes_fp8():
        pytest.skip(why + " (runs on AVX-512 and AMX hosts)")
    import vllm._custom_ops  # noqa: F401

    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x.float())][: 64 * 512].reshape(512, 1, 64)  # [T, H, D] finite bf16, every exponent
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        for scale in (1.0, 0.37):
            cache = torch.zeros((4, 1, 128, 128), dtype=torch.uint8)
            k, v = cache.view(4, 1, 256, 64).chunk(2, dim=2)
            torch.ops._C.cpu_attn_reshape_and_cache(x, x, k, v, torch.arange(512), "vec", scale, scale, name)
            want = quantize(x, dtype, scale).view(torch.uint8)
            got = v.reshape(4, 128, 64)  # VEC: V half of a page is [tokens, head] (one head)
            assert torch.equal(got.reshape(512, 64), want.reshape(512, 64)), (name, scale)
