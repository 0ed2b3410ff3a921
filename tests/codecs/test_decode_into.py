"""Decoding straight into page extents leaves exactly what decoding then copying does, and writes nothing it must not.

Every codec with a ``decode_into`` (splitzip, zstd, rans on bfloat16; zstd on
float16) against its own ``decode``: real KV, escape-heavy and random bits,
any split of the destination into extents with gaps between them (the gaps
must stay as they were), and untrusted payloads (truncated, hostile escape
positions) refused before the first byte lands. Where a codec cannot (float32,
float8, raw, extents that do not hold the object) it says so and writes
nothing; the fetcher then decodes and copies.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.support.adversarial import bits_view, random_bits
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.into_pages import PageExtents
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import CodecError, KVCodecError
from vllm_kvcodec.format import decode_payload_into, encode_chunk, read_header

INTO = [("splitzip", torch.bfloat16), ("zstd", torch.bfloat16), ("rans", torch.bfloat16), ("zstd", torch.float16)]
CANARY = 0xA5


class Pages:
    """A destination buffer cut into extents of the given byte lengths, with a canary-filled gap after each."""

    def __init__(self, lengths: list[int], gap: int = 12) -> None:
        self.buf = bytearray([CANARY]) * (sum(lengths) + gap * len(lengths))
        view = memoryview(self.buf)
        self.spans, at = [], 0
        for n in lengths:
            self.spans.append((at, n))
            at += n + gap
        self.extents = PageExtents([view[a : a + n] for a, n in self.spans])

    def written(self) -> bytes:
        return b"".join(self.buf[a : a + n] for a, n in self.spans)

    def gaps_untouched(self) -> bool:
        ends = [a + n for a, n in self.spans]
        starts = [a for a, _ in self.spans[1:]] + [len(self.buf)]
        return all(set(self.buf[e:s]) <= {CANARY} for e, s in zip(ends, starts))

    def untouched(self) -> bool:
        return set(self.buf) == {CANARY}


def cut(nbytes: int, pieces: list[int], unit: int = 4) -> list[int]:
    """``nbytes`` in extents at the given (sorted, unit-aligned) cut points."""
    points = sorted({p * unit for p in pieces if 0 < p * unit < nbytes})
    return [b - a for a, b in zip([0, *points], [*points, nbytes])]


def decode_into(kv: torch.Tensor, codec: str, lengths: list[int]) -> Pages:
    blob = encode_chunk(kv, codec)
    pages = Pages(lengths)
    assert decode_payload_into(blob, read_header(blob), pages.extents)
    return pages


def kv_bytes(kv: torch.Tensor) -> bytes:
    return bits_view(kv.contiguous()).numpy().tobytes()


@pytest.mark.parametrize("codec,dtype", INTO, ids=str)
def test_real_kv_into_scattered_extents(codec: str, dtype: torch.dtype, real_chunks: list[torch.Tensor]) -> None:
    for chunk in real_chunks[:2]:
        kv = chunk.to(dtype)
        nbytes = kv.numel() * kv.element_size()
        pages = decode_into(kv, codec, cut(nbytes, list(range(0, nbytes // 4, 4099))))
        assert pages.written() == kv_bytes(kv) and pages.gaps_untouched()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_split_any_values(data) -> None:
    """Random bits (escapes everywhere) or KV-like values with rare escapes, cut anywhere on a 4-byte boundary."""
    codec, dtype = data.draw(st.sampled_from(INTO))
    shape = (2, 2, data.draw(st.integers(1, 40)), data.draw(st.integers(1, 3)), 2 * data.draw(st.integers(1, 8)))
    seed = data.draw(st.integers(0, 2**16))
    if data.draw(st.booleans()):
        kv = random_bits(shape, dtype, seed=seed)
    else:
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(shape, generator=g) * 0.5
        kv.view(-1)[:: data.draw(st.integers(3, 200))] = 1e30 if dtype == torch.bfloat16 else 1e4
        kv = kv.to(dtype)
    nbytes = kv.numel() * kv.element_size()
    pieces = data.draw(st.lists(st.integers(0, nbytes // 4), max_size=12))
    pages = decode_into(kv, codec, cut(nbytes, pieces))
    assert pages.written() == kv_bytes(kv) and pages.gaps_untouched()


@pytest.mark.parametrize("codec,dtype", INTO, ids=str)
def test_a_truncated_payload_writes_nothing(codec: str, dtype: torch.dtype) -> None:
    kv = random_bits((2, 2, 64, 2, 32), dtype)
    payload = memoryview(encode_chunk(kv, codec))
    header = read_header(bytes(payload))
    body = payload[header.payload_offset : header.payload_offset + header.payload_length]
    pages = Pages(cut(kv.numel() * 2, [100, 300]))
    with pytest.raises(KVCodecError):
        get_codec(header.codec_config["id"]).decode_into(body[:-7], header.dtype, header.shape, pages.extents)
    assert pages.untouched()


@pytest.mark.parametrize("positions", [[5, 5], [9, 3], [0, 1 << 20]], ids=["repeated", "decreasing", "out_of_range"])
def test_hostile_splitzip_escapes_are_refused_before_a_write(positions: list[int]) -> None:
    n = 2 * 2 * 64 * 2 * 32
    kv = random_bits((2, 2, 64, 2, 32), torch.bfloat16)
    payload = bytearray(get_codec("splitzip").encode(bits_view(kv).numpy(), DType.BFLOAT16))
    m = int.from_bytes(payload[16:20], "little")
    assert m >= 2  # random bits escape often
    at = 20 + n // 2 + n  # codebook, m, codes, sign-mantissa: then the positions
    for i, p in enumerate(positions):
        payload[at + 4 * i : at + 4 * i + 4] = p.to_bytes(4, "little")
    pages = Pages(cut(2 * n, [64, 512, 1000]))
    with pytest.raises(CodecError, match="escape positions"):
        get_codec("splitzip").decode_into(memoryview(bytes(payload)), DType.BFLOAT16, tuple(kv.shape), pages.extents)
    assert pages.untouched()


@pytest.mark.parametrize("codec,dtype", [("splitzip", torch.float32), ("zstd", torch.float32), ("rans", torch.float32),
                                         ("raw", torch.bfloat16)], ids=str)
def test_where_a_codec_cannot_it_says_so_and_writes_nothing(codec: str, dtype: torch.dtype) -> None:
    kv = random_bits((2, 2, 16, 2, 8), dtype)
    blob = encode_chunk(kv, codec)
    pages = Pages([kv.numel() * kv.element_size()])
    assert not decode_payload_into(blob, read_header(blob), pages.extents)
    assert pages.untouched()


def test_zstd_float8_is_left_to_decode_and_copy() -> None:
    kv = random_bits((2, 2, 16, 2, 8), torch.float16).view(torch.uint8).view(torch.float8_e4m3fn)
    blob = encode_chunk(kv, "zstd")
    pages = Pages([kv.numel()])
    assert not decode_payload_into(blob, read_header(blob), pages.extents) and pages.untouched()


@pytest.mark.parametrize("codec,lengths", [
    *[(c, n) for c in ("splitzip", "zstd", "rans") for n in ([8190], [8194], [4093, 4099])],
    ("splitzip", [4094, 4098]),  # whole values, but splitzip writes whole pairs
], ids=str)
def test_extents_that_do_not_hold_the_object_are_refused(codec: str, lengths: list[int]) -> None:
    kv = random_bits((2, 2, 16, 2, 32), torch.bfloat16)  # 4096 values, 8192 bytes
    blob = encode_chunk(kv, codec)
    pages = Pages(lengths)
    assert not decode_payload_into(blob, read_header(blob), pages.extents) and pages.untouched()
