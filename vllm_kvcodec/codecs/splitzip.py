"""SplitZip (arXiv 2605.01708): a fixed 4-bit code for the 16 most common exponents.

Each value splits into its exponent byte and its sign+mantissa bits. The
exponents of a chunk are coded with 4 bits against a 16-entry codebook chosen
*per chunk* and stored in it (the paper's codec holds one global, offline
codebook, so only a reader with that object can decode; here any reader can).
Values whose exponent is not in the codebook are escapes: the dense stream
holds code 0 for them and a sparse stream lists (position, exponent). The
sign+mantissa bits are stored raw: they are incompressible (7.96 bits/byte on
real KV).

Payload (little-endian; ``n`` elements, ``m`` escapes, ``r`` sign+mantissa
bytes per element: 1 for bfloat16, 3 for float32)::

    codebook   16 x u8         exponent of codes 0..15
    m          u32
    codes      ceil(n/2) x u8  element 2i in the high nibble, 2i+1 in the low
    signman    n*r x u8        bf16: sign<<7 | mantissa7;  f32: sign<<23 | mantissa23, 3 bytes LE
    positions  m x u32         strictly increasing element indices
    exponents  m x u8

float16 has a 5-bit exponent and 11 sign+mantissa bits, which do not split into
whole bytes: the codec refuses it (use ``zstd`` or ``raw``).
"""

from __future__ import annotations

import numpy as np

from vllm_kvcodec.codecs import splitzip_kernels as k
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.into_pages import PageExtents
from vllm_kvcodec.codecs.registry import register_codec
from vllm_kvcodec.codecs.validate import Reader, expect_at_most
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import CodecError

CODEBOOK_SIZE = 16


@register_codec
class SplitZipCodec(Codec):
    codec_id = "splitzip"
    dtypes = frozenset({DType.BFLOAT16, DType.FLOAT32})

    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        flat = np.ascontiguousarray(bits).reshape(-1)
        streams = encode_streams(flat, dtype)
        return b"".join(streams)  # numpy arrays join through the buffer protocol, without a copy each

    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        return decode_streams(Reader(payload, "splitzip payload"), n, dtype).reshape(shape)

    def decode_into(self, payload: memoryview, dtype: DType, shape: tuple[int, ...], extents: PageExtents) -> bool:
        n = int(np.prod(shape, dtype=np.int64))
        return decode_streams_into(Reader(payload, "splitzip payload"), n, dtype, extents)


def choose_codebook(hist: np.ndarray) -> np.ndarray:
    """The 16 most frequent exponents, most frequent first (ties: smaller exponent)."""
    return np.argsort(-hist, kind="stable")[:CODEBOOK_SIZE].astype(np.uint8)


def _tables(codebook: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    code_of = np.zeros(256, dtype=np.uint8)
    is_escape = np.ones(256, dtype=np.uint8)
    # Reverse order so that a duplicated entry maps to its first code.
    for code in range(CODEBOOK_SIZE - 1, -1, -1):
        code_of[codebook[code]] = code
        is_escape[codebook[code]] = 0
    return code_of, is_escape


def encode_streams(flat: np.ndarray, dtype: DType) -> list:
    """The payload's streams in order: codebook, m, codes, signman, positions, exponents."""
    if dtype is DType.BFLOAT16:
        return _encode_bf16(flat)
    return _encode_f32(flat)


def _encode_bf16(values: np.ndarray) -> list:
    n = values.shape[0]
    even = n - (n & 1)
    words = values[:even].view(np.uint32)
    tail = values[even:]
    hist = k.exponent_histogram_bf16(words, tail)
    codebook = choose_codebook(hist)
    code_of, is_escape = _tables(codebook)
    n_escapes = int(hist[is_escape.astype(bool)].sum())
    if tail.size:  # pad to a whole pair with a value that is not an escape
        padded = np.array([tail[0], np.uint16(int(codebook[0]) << 7)], dtype=np.uint16)
        words = np.concatenate([words, padded.view(np.uint32)])
    n_pairs = words.shape[0]
    codes = np.empty(n_pairs, dtype=np.uint8)
    signman = np.empty(n_pairs, dtype=np.uint16)
    flags = np.empty(-(-n_pairs // k.BLOCK_PAIRS), dtype=np.uint8)
    lut = code_of.astype(np.uint32) | (is_escape.astype(np.uint32) << 8)
    k.encode_pairs_bf16(words, lut, codes, signman, flags)
    positions = np.empty(n_escapes, dtype=np.uint32)
    exponents = np.empty(n_escapes, dtype=np.uint8)
    if n_escapes:
        found = k.gather_escapes_bf16(values, is_escape, flags, positions, exponents)
        assert found == n_escapes, (found, n_escapes)
    sm = signman.view(np.uint8)[:n]
    return [codebook, np.uint32(n_escapes).tobytes(), codes, sm, positions, exponents]


def _encode_f32(values: np.ndarray) -> list:
    exps = ((values >> 23) & 0xFF).astype(np.uint8)
    codebook = choose_codebook(np.bincount(exps, minlength=256))
    code_of, is_escape = _tables(codebook)
    codes4 = code_of[exps]
    if codes4.size & 1:
        codes4 = np.append(codes4, np.uint8(0))
    codes = (codes4[0::2] << 4) | codes4[1::2]
    rest = ((values & 0x7FFFFF) | ((values >> 8) & 0x800000)).astype("<u4")
    signman = rest.view(np.uint8).reshape(-1, 4)[:, :3]
    positions = np.flatnonzero(is_escape[exps]).astype("<u4")
    return [codebook, np.uint32(positions.size).tobytes(), codes, np.ascontiguousarray(signman), positions, exps[positions]]


def decode_streams(reader: Reader, n: int, dtype: DType) -> np.ndarray:
    """Validate every stream's size against ``n`` before allocating the output."""
    codebook, codes, signman, positions, exponents = _streams(reader, n, dtype)
    if dtype is DType.BFLOAT16:
        out = _decode_bf16(codebook, codes, signman, n)
        ok = k.patch_escapes_bf16(out, positions, exponents)
    else:
        out = _decode_f32(codebook, codes, signman, n)
        ok = k.patch_escapes_f32(out, positions, exponents)
    if not ok:
        raise CodecError("splitzip escape positions are out of range or not strictly increasing")
    return out


def decode_streams_into(reader: Reader, n: int, dtype: DType, extents: PageExtents) -> bool:
    """:func:`decode_streams` straight into page extents (bfloat16, whole pairs); False, writing nothing, elsewhere."""
    if dtype is not DType.BFLOAT16 or n & 1 or not extents.holds(2 * n, 4):
        return False
    codebook, codes, signman, positions, exponents = _streams(reader, n, dtype)
    if not k.decode_pairs_bf16_into(codes, signman.view("<u2"), _pair_lut(codebook), positions, exponents,
                                    extents.addresses, extents.nbytes):
        raise CodecError("splitzip escape positions are out of range or not strictly increasing")
    return True


def _streams(reader: Reader, n: int, dtype: DType) -> tuple[np.ndarray, ...]:
    """codebook, codes, signman, positions, exponents: every size checked against ``n``, nothing allocated."""
    rest_bytes = 1 if dtype is DType.BFLOAT16 else 3
    codebook = np.frombuffer(reader.take(CODEBOOK_SIZE, "codebook"), dtype=np.uint8)
    m = reader.u32("escape count")
    expect_at_most("splitzip escape count", m, n)
    codes = np.frombuffer(reader.take((n + 1) // 2, "codes"), dtype=np.uint8)
    signman = np.frombuffer(reader.take(n * rest_bytes, "sign-mantissa"), dtype=np.uint8)
    positions = np.frombuffer(reader.take(4 * m, "escape positions"), dtype="<u4")
    exponents = np.frombuffer(reader.take(m, "escape exponents"), dtype=np.uint8)
    reader.finish()
    return codebook, codes, signman, positions, exponents


def _pair_lut(codebook: np.ndarray) -> np.ndarray:
    """Code byte -> both exponents of a bf16 pair in place in its 32-bit word."""
    cb = codebook.astype(np.uint32)
    byte = np.arange(256, dtype=np.uint32)
    return (cb[byte >> 4] << 7) | (cb[byte & 15] << 23)


def _decode_bf16(codebook: np.ndarray, codes: np.ndarray, signman: np.ndarray, n: int) -> np.ndarray:
    pair_lut = _pair_lut(codebook)
    n_pairs = codes.shape[0]
    if n & 1:
        signman = np.append(signman, np.uint8(0))
    words = np.empty(n_pairs, dtype=np.uint32)
    quads = n_pairs // 4  # little-endian wide loads: byte order is the stream order
    k.decode_quads_bf16(codes[: 4 * quads].view("<u4"), signman[: 8 * quads].view("<u8"), pair_lut, words[: 4 * quads])
    k.decode_pairs_bf16(codes[4 * quads :], signman[8 * quads :], pair_lut, words[4 * quads :])
    return words.view(np.uint16)[:n]


def _decode_f32(codebook: np.ndarray, codes: np.ndarray, signman: np.ndarray, n: int) -> np.ndarray:
    nib = np.empty(codes.size * 2, dtype=np.uint8)
    nib[0::2], nib[1::2] = codes >> 4, codes & 15
    exps = codebook[nib[:n]].astype(np.uint32)
    rest = np.zeros((n, 4), dtype=np.uint8)
    rest[:, :3] = signman.reshape(n, 3)
    r = rest.view("<u4").reshape(n).astype(np.uint32)
    return ((r & 0x800000) << 8) | (exps << 23) | (r & 0x7FFFFF)
