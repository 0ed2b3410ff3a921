"""Flag VALUE_DIGEST: a chunk's segmented XXH3-64 of its decoded values, checked by every decoder.

The digest vouches for what a decoder produced (a hardware video decoder can
conceal a damaged picture), where the trailer vouches for the stored bytes. Its
segments are independent so a device hashes them in parallel
(:mod:`vllm_kvcodec.gpu.value_digest_triton`); the CPU reader checks it too.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash

from tests.support.adversarial import bits_view, reseal
from vllm_kvcodec import format as fmt
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import ValueDigest, build_chunk, decode_chunk, encode_chunk, read_header

CODECS = ["raw", "zstd", "splitzip", "rans"]


@pytest.mark.parametrize("codec", CODECS)
def test_chunk_with_a_value_digest_round_trips(codec: str, small_kv) -> None:
    blob = encode_chunk(small_kv, codec, key="k1", value_digest_segment=4096)
    header = read_header(blob, key="k1")
    raw = bits_view(small_kv).numpy().tobytes()
    assert header.value_digest == ValueDigest(4096, fmt.value_digest(raw, 4096))
    assert header.key_digest == fmt.key_digest("k1")
    assert torch.equal(bits_view(decode_chunk(blob, key="k1")), bits_view(small_kv))
    assert fmt.header_length(blob[: fmt.FIXED_HEADER_BYTES]) == header.payload_offset  # ranged readers agree


def test_chunks_without_one_are_unchanged(small_kv) -> None:
    blob = encode_chunk(small_kv, "raw", key="k1")
    assert struct.unpack_from("<H", blob, 10)[0] == fmt.KEY_BOUND and read_header(blob).value_digest is None
    assert blob == encode_chunk(small_kv, "raw", key="k1", value_digest_segment=0)


def test_values_that_differ_from_the_digest_are_rejected(small_kv) -> None:
    """A payload that decodes, under a valid trailer, to values other than those digested: rejected."""
    from vllm_kvcodec.codecs.dtypes import DType

    bits = bits_view(small_kv).numpy().copy()
    digest = ValueDigest(1024, fmt.value_digest(bits.tobytes(), 1024))
    bits.reshape(-1)[777] ^= 1
    blob = build_chunk(bits.tobytes(), DType.BFLOAT16, tuple(small_kv.shape), {"id": "raw"}, value_digest=digest)
    with pytest.raises(ChunkFormatError, match="value digest mismatch"):
        decode_chunk(blob)


@pytest.mark.parametrize("segment", [0, 512, 3000, 1 << 31])
def test_segment_sizes_a_reader_refuses(segment: int, small_kv) -> None:
    blob = bytearray(encode_chunk(small_kv, "raw", value_digest_segment=1024))
    at = fmt.FIXED_HEADER_BYTES + 4 * small_kv.dim()
    struct.pack_into("<I", blob, at, segment)
    with pytest.raises(ChunkFormatError, match="segment"):
        read_header(reseal(blob))
    with pytest.raises(ChunkFormatError, match="segment"):
        encode_chunk(small_kv, "raw", value_digest_segment=segment or 100)


def test_unknown_flags_are_still_refused(small_kv) -> None:
    blob = bytearray(encode_chunk(small_kv, "raw"))
    for flag in (0x8, 0x10, 0x8000):
        bad = bytearray(blob)
        struct.pack_into("<H", bad, 10, flag)
        with pytest.raises(ChunkFormatError, match="unknown header flags"):
            read_header(reseal(bad))


def test_flag_without_room_for_its_section_is_refused(small_kv) -> None:
    """Setting the flag on a chunk that has no section: the size equation no longer holds."""
    blob = bytearray(encode_chunk(small_kv, "raw"))
    struct.pack_into("<H", blob, 10, fmt.VALUE_DIGEST)
    with pytest.raises(ChunkFormatError):
        decode_chunk(reseal(blob))


@pytest.mark.parametrize("nbytes,segment,count", [
    (1, 1024, 1), (240, 1024, 1), (1024, 1024, 1), (1024 + 240, 1024, 1), (1024 + 241, 1024, 2),
    (5 * 4096, 4096, 5), (5 * 4096 + 240, 4096, 5), (5 * 4096 + 241, 4096, 6),
])
def test_segments_and_the_short_tail_rule(nbytes: int, segment: int, count: int) -> None:
    parts = fmt.digest_segments(nbytes, segment)
    assert len(parts) == count and parts[0][0] == 0 and parts[-1][1] == nbytes
    assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))
    assert all(b - a > 240 for a, b in parts) or count == 1
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    want = xxhash.xxh3_64_intdigest(b"".join(struct.pack("<Q", xxhash.xxh3_64_intdigest(data[a:b])) for a, b in parts))
    assert fmt.value_digest(data, segment) == want


def test_decode_into_pages_defers_to_the_checked_decode(small_kv) -> None:
    """A chunk with a value digest is never written straight into pages: decoded, checked, then copied."""
    from vllm_kvcodec.codecs.into_pages import PageExtents

    blob = encode_chunk(small_kv, "splitzip", value_digest_segment=1024)
    header = read_header(blob)
    page = bytearray(small_kv.numel() * 2)
    assert fmt.decode_payload_into(blob, header, PageExtents([memoryview(page)])) is False
    assert not any(page)
    plain = encode_chunk(small_kv, "splitzip")
    assert fmt.decode_payload_into(plain, read_header(plain), PageExtents([memoryview(page)]))
