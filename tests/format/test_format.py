"""The chunk container rejects anything it cannot vouch for, with one exception family."""

from __future__ import annotations

import struct

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from tests.support.adversarial import bits_view, reseal
from vllm_kvcodec.codecs.policy import DEFAULT_CODEC
from vllm_kvcodec import format as fmt
from vllm_kvcodec.errors import ChunkFormatError, UnsupportedDTypeError
from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header

CODECS = ["raw", "zstd", "splitzip", "rans"]


def test_header_describes_the_chunk(small_kv) -> None:
    blob = encode_chunk(small_kv, "zstd", level=3)
    header = read_header(blob)
    assert header.version == fmt.VERSION
    assert header.shape == tuple(small_kv.shape)
    assert header.codec_config == {"id": "zstd", "level": 3}
    assert header.raw_nbytes == small_kv.numel() * 2
    assert blob[:4] == b"KVCZ"


def test_default_codec_is_lossless(small_kv) -> None:
    blob = encode_chunk(small_kv)
    assert read_header(blob).codec_id == DEFAULT_CODEC
    assert torch.equal(bits_view(decode_chunk(blob)), bits_view(small_kv))


def test_non_contiguous_input_is_encoded_as_its_logical_values(real_chunks) -> None:
    view = real_chunks[0].transpose(2, 3)[:, :, :, :5]
    assert torch.equal(bits_view(decode_chunk(encode_chunk(view, "splitzip"))), bits_view(view.contiguous()))


@pytest.mark.parametrize("codec", CODECS)
def test_every_single_bit_flip_is_detected(codec: str, small_kv) -> None:
    blob = encode_chunk(small_kv[:1, :, :4], codec)
    for i in range(len(blob)):
        for bit in (0, 7):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises(ChunkFormatError):
                decode_chunk(bytes(bad))


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_extended_blobs_are_rejected(codec: str, small_kv) -> None:
    blob = encode_chunk(small_kv, codec)
    for cut in (0, 1, 4, 19, len(blob) // 2, len(blob) - 9, len(blob) - 1):
        with pytest.raises(ChunkFormatError):
            decode_chunk(blob[:cut])
    for extra in (b"\0", b"junk" * 100):
        with pytest.raises(ChunkFormatError):
            decode_chunk(blob + extra)
        with pytest.raises(ChunkFormatError):
            decode_chunk(reseal(blob[:-8] + extra + blob[-8:]))


def test_wrong_version_and_magic_are_named(small_kv) -> None:
    blob = bytearray(encode_chunk(small_kv, "raw"))
    bad = bytearray(blob)
    bad[4:6] = struct.pack("<H", 2)
    with pytest.raises(ChunkFormatError, match="version 2"):
        decode_chunk(reseal(bad))
    bad = bytearray(blob)
    bad[:4] = b"GGUF"
    with pytest.raises(ChunkFormatError, match="magic"):
        decode_chunk(bytes(bad))


@pytest.mark.parametrize(
    "offset,value,message",
    [
        (6, b"\x09", "dtype"),  # unknown dtype code
        (7, b"\x00", "ndim"),
        (7, b"\x09", "ndim"),
        (8, struct.pack("<H", 5000), "config"),
        (10, struct.pack("<H", 0x80), "flags"),
        (12, struct.pack("<Q", 1 << 40), "sizes disagree"),
        (20, struct.pack("<I", 0), "empty"),
        (20, struct.pack("<I", 0xFFFFFFFF), "exceeds"),
    ],
)
def test_malformed_fields_behind_a_valid_checksum(offset: int, value: bytes, message: str, small_kv) -> None:
    blob = bytearray(encode_chunk(small_kv, "raw"))
    blob[offset : offset + len(value)] = value
    with pytest.raises(ChunkFormatError, match=message):
        decode_chunk(reseal(blob))


@pytest.mark.parametrize("codec", ["zstd", "splitzip", "rans"])
def test_shape_that_disagrees_with_payload_is_rejected(codec: str, small_kv) -> None:
    """A header that promises more elements than the payload holds must not decode."""
    blob = bytearray(encode_chunk(small_kv, codec))
    blob[20:24] = struct.pack("<I", small_kv.shape[0] + 1)
    with pytest.raises(ChunkFormatError):
        decode_chunk(reseal(blob))


def test_unknown_codec_in_header(small_kv) -> None:
    blob = encode_chunk(small_kv, "raw")
    header = read_header(blob)
    config = b'{"id":"rax"}'
    assert len(config) == len(b'{"id":"raw"}')
    forged = blob.replace(b'{"id":"raw"}', config, 1)
    with pytest.raises(ChunkFormatError, match="cannot build"):
        decode_chunk(reseal(forged))
    assert header.codec_id == "raw"


def test_unsupported_dtype_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedDTypeError, match="bfloat16, float16, float32, float8_e4m3fn or float8_e5m2"):
        encode_chunk(torch.zeros(4, dtype=torch.int8), "raw")
    with pytest.raises(UnsupportedDTypeError, match="cannot encode float16"):
        encode_chunk(torch.zeros(4, dtype=torch.float16), "splitzip")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_buffers_raise_only_the_format_error(data: bytes) -> None:
    with pytest.raises(ChunkFormatError):
        decode_chunk(data)
    with pytest.raises(ChunkFormatError):
        decode_chunk(b"KVCZ\x01\x00" + data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CODECS), st.data())
def test_mutated_payloads_behind_a_valid_checksum(codec: str, data) -> None:
    """Crafted chunks (valid checksum, garbage payload) fail cleanly or decode to the promised shape."""
    kv = torch.randn(2, 2, 8, 3, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    blob = bytearray(encode_chunk(kv, codec))
    header = read_header(blob)
    start = header.payload_offset
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(start, len(blob) - 9))
        blob[i] = data.draw(st.integers(0, 255))
    try:
        out = decode_chunk(reseal(blob))
    except ChunkFormatError:
        return
    assert out.shape == kv.shape and out.dtype == kv.dtype


def test_settings_no_encoder_writes_are_rejected(real_chunks) -> None:
    """A forged header must not steer the decoder (say, 64 libav threads): only get_config() is accepted."""
    from vllm_kvcodec.format import build_chunk

    kv = real_chunks[0][:2]
    blob = encode_chunk(kv, "video")
    header = read_header(blob)
    payload = bytes(memoryview(blob)[header.payload_offset : header.payload_offset + header.payload_length])
    honest = build_chunk(payload, header.dtype, header.shape, header.codec_config)
    assert decode_chunk(honest).equal(kv)
    forged = build_chunk(payload, header.dtype, header.shape, {**header.codec_config, "threads": 64})
    with pytest.raises(ChunkFormatError, match="not one an encoder writes"):
        decode_chunk(forged)


# --------------------------------------------------------------------------- key binding


def test_key_bound_chunk_round_trips_under_its_key(small_kv) -> None:
    key = "kvc/ns/aaaa/r0g000"
    blob = encode_chunk(small_kv, "rans", key=key)
    header = read_header(blob, key=key)
    assert header.key_digest == fmt.key_digest(key)
    assert len(blob) == len(encode_chunk(small_kv, "rans")) + 8
    assert torch.equal(bits_view(decode_chunk(blob, key=key)), bits_view(small_kv))
    assert torch.equal(bits_view(decode_chunk(blob)), bits_view(small_kv))  # tools without the key still read it


def test_swapped_object_is_rejected(real_chunks) -> None:
    """Two intact chunks of the same shape under each other's keys: the checksum passes, the binding does not."""
    a, b = "kvc/ns/aaaa/r0g001", "kvc/ns/bbbb/r0g001"
    blob_a = encode_chunk(real_chunks[0][:5], "rans", key=a)
    blob_b = encode_chunk(real_chunks[1][:5], "rans", key=b)
    fmt.verify_checksum(blob_b)
    with pytest.raises(ChunkFormatError, match="another key"):
        decode_chunk(blob_b, key=a)
    with pytest.raises(ChunkFormatError, match="another key"):
        read_header(blob_a, key=b)
    assert torch.equal(bits_view(decode_chunk(blob_a, key=a)), bits_view(real_chunks[0][:5]))


def test_reader_that_asks_for_a_key_rejects_unbound_chunks(small_kv) -> None:
    with pytest.raises(ChunkFormatError, match="not bound"):
        decode_chunk(encode_chunk(small_kv, "raw"), key="kvc/ns/aaaa/r0g000")


@pytest.mark.parametrize("codec", ["raw", "rans"])
def test_every_single_bit_flip_of_a_key_bound_chunk_is_detected(codec: str, small_kv) -> None:
    key = "kvc/ns/aaaa/r0g000"
    blob = encode_chunk(small_kv[:1, :, :4], codec, key=key)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 1 << (i % 8)
        with pytest.raises(ChunkFormatError):
            decode_chunk(bytes(bad), key=key)


def test_forged_binding_behind_a_valid_checksum_is_rejected(small_kv) -> None:
    key = "kvc/ns/aaaa/r0g000"
    blob = bytearray(encode_chunk(small_kv, "raw", key=key))
    at = 20 + 4 * small_kv.dim()
    blob[at : at + 8] = struct.pack("<Q", fmt.key_digest("kvc/ns/bbbb/r0g000"))
    with pytest.raises(ChunkFormatError, match="another key"):
        decode_chunk(reseal(blob), key=key)
    blob[10:12] = struct.pack("<H", 0)  # drop the flag: the sizes no longer add up
    with pytest.raises(ChunkFormatError, match="sizes disagree"):
        decode_chunk(reseal(blob))
