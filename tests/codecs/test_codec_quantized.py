"""The lossy ``quantized`` codec (LOSSY: NOT BIT-EXACT), on real SmolLM2 KV: what is exact about it, and what is not.

Exact: the integer stream (decoding gives the reference dequantisation of the
quantised integers, bit for bit), the kept full-precision layers and sink
tokens, and the refusals (a chunk holding NaN or inf is not quantised; a
payload whose scales or integers are bad is a failed load). Bounded: every
quantised value lies within half a step of the original.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.adversarial import SCALE_DAMAGE, bad_scales_payload, reseal
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.dtypes import DType, tensor_to_bits
from vllm_kvcodec.codecs.policy import LossyCodecError, check_spec
from vllm_kvcodec.codecs.precision import Precision
from vllm_kvcodec.codecs.quantized import NonFiniteKVError, QuantizedCodec, dequantize
from vllm_kvcodec.errors import ChunkFormatError, CodecError
from vllm_kvcodec.format import decode_chunk, encode_chunk, payload_of, read_header

LEVELS = ["int8", "int6", "int4"]


@pytest.fixture(scope="module")
def chunk(real_chunks) -> torch.Tensor:
    """One real 256-token chunk, 8 layers: [8, 2, 256, 3, 64] bf16."""
    return real_chunks[1][:8].contiguous()


def unpacked(blob: bytes):
    header = read_header(blob)
    codec = get_codec(header.codec_config)
    return codec, codec.unpack(payload_of(blob, header), header.dtype, header.shape)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decoding_is_the_reference_dequantisation_of_the_integers_bit_for_bit(chunk, level, dtype) -> None:
    kv = chunk.to(dtype)
    blob = encode_chunk(kv, precision=level)
    codec, parts = unpacked(blob)
    assert isinstance(codec, QuantizedCodec) and codec.bits == Precision(level).bits
    x = kv.float().numpy()
    # The integers the stream holds are the ones quantising the original with the stored scales gives: it is lossless.
    q_k = np.clip(np.rint((x[:, 0] - parts.k_min[:, None]) / parts.k_step[:, None]), 0, codec.levels)
    q_v = np.clip(np.rint((x[:, 1] - parts.v_min[..., None]) / parts.v_step[..., None]), 0, codec.levels)
    assert np.array_equal(parts.keys, q_k.astype(np.uint8)) and np.array_equal(parts.values, q_v.astype(np.uint8))
    # Decoding is their reference dequantisation (float32 multiply, then add; rounded to the dtype), bit for bit.
    want = torch.stack([torch.from_numpy(dequantize(parts.keys, parts.k_min[:, None], parts.k_step[:, None])),
                        torch.from_numpy(dequantize(parts.values, parts.v_min[..., None], parts.v_step[..., None]))],
                       dim=1).to(dtype)
    got = decode_chunk(blob)
    assert got.dtype == dtype and got.shape == kv.shape
    assert np.array_equal(tensor_to_bits(got)[0], tensor_to_bits(want)[0])


@pytest.mark.parametrize("level", LEVELS)
def test_every_value_lies_within_half_a_step_of_the_original(chunk, level) -> None:
    blob = encode_chunk(chunk, precision=level)
    _, parts = unpacked(blob)
    x = chunk.float().numpy()
    y_k = dequantize(parts.keys, parts.k_min[:, None], parts.k_step[:, None])
    y_v = dequantize(parts.values, parts.v_min[..., None], parts.v_step[..., None])
    slack = np.float32(1e-6)  # the two float32 roundings of the dequantisation
    assert (np.abs(y_k - x[:, 0]) <= parts.k_step[:, None] * (0.5 + slack) + np.abs(x[:, 0]) * slack).all()
    assert (np.abs(y_v - x[:, 1]) <= parts.v_step[..., None] * (0.5 + slack) + np.abs(x[:, 1]) * slack).all()
    assert (parts.keys.max(), parts.values.max()) <= (get_codec(read_header(blob).codec_config).levels,) * 2


def test_full_precision_layers_and_sink_tokens_come_back_bit_exact(chunk) -> None:
    blob = encode_chunk(chunk, precision=Precision("int4", sink_tokens=4, full_layers=2))
    got = decode_chunk(blob)
    assert read_header(blob).codec_config == {"id": "quantized", "bits": 4, "entropy": "rans", "sink_tokens": 4,
                                              "full_layers": 2}
    bits, want = tensor_to_bits(got)[0], tensor_to_bits(chunk)[0]
    assert np.array_equal(bits[:2], want[:2]) and np.array_equal(bits[2:, :, :4], want[2:, :, :4])
    assert not np.array_equal(bits[2:, :, 4:], want[2:, :, 4:]), "the rest is quantised"


def test_a_chunk_holding_nan_or_inf_is_not_quantised(chunk) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        kv = chunk.clone()
        kv[3, 1, 100, 2, 7] = bad
        with pytest.raises(NonFiniteKVError):
            encode_chunk(kv, precision="int8")


def _scales_at(blob: bytes) -> int:
    """Where the quantized payload's scales section (after its u32 size) starts in the blob."""
    return len(blob) - 8 - read_header(blob).payload_len + 4


@pytest.mark.parametrize("damage", [*SCALE_DAMAGE, "integer range"])
def test_bad_scales_or_integers_are_a_failed_load(chunk, damage) -> None:
    """Each damage is resealed (a valid checksum), so the codec's own checks must catch it."""
    kv = chunk[:2].contiguous()
    if damage == "integer range":
        codec = QuantizedCodec(bits=4)
        forged = QuantizedCodec(bits=8).encode(tensor_to_bits(kv)[0], DType.BFLOAT16)
        with pytest.raises(CodecError, match="exceed 15"):
            codec.decode(memoryview(forged), DType.BFLOAT16, tuple(kv.shape))  # 8-bit integers read as 4-bit
        return
    parts = QuantizedCodec(bits=8)
    good = parts.unpack(memoryview(parts.encode(tensor_to_bits(kv)[0], DType.BFLOAT16)), DType.BFLOAT16, tuple(kv.shape))
    blob = _chunk_around(kv, bad_scales_payload(good, damage))
    with pytest.raises(ChunkFormatError):
        decode_chunk(blob)


def _chunk_around(kv: torch.Tensor, payload: bytes) -> bytes:
    from vllm_kvcodec.format import build_chunk

    return reseal(build_chunk(payload, DType.BFLOAT16, tuple(kv.shape), {"id": "quantized", "bits": 8,
                                                                          "entropy": "rans"}))


def test_lossy_only_through_a_precision_level(chunk) -> None:
    """A lossy codec is never reachable by naming it as a codec: not in encode_chunk, not in a config."""
    with pytest.raises(LossyCodecError):
        encode_chunk(chunk, codec="quantized")
    with pytest.raises(LossyCodecError):
        check_spec("quantized", allow_auto=True)
    assert read_header(encode_chunk(chunk)).codec_id == "rans"  # the default stays lossless
    assert read_header(encode_chunk(chunk, precision="lossless")).codec_id == "rans"


def test_a_non_canonical_chunk_is_refused(chunk) -> None:
    with pytest.raises(CodecError, match="canonical"):
        encode_chunk(chunk.reshape(8, 512, 3, 64), precision="int8")
