"""Numba kernels of the SplitZip CPU codec.

Written branch-free over *pairs* of 16-bit values (one code byte, two
sign-mantissa bytes, one 32-bit output word per pair) so that LLVM vectorises
them; the 256-entry lookup tables stay in L1. Escapes are rare (0.06% on real
KV), so they are handled in a separate pass that only visits blocks whose
vectorised flag reduction says they hold one.
"""

from __future__ import annotations

import vllm_kvcodec.codecs.numba_compat  # noqa: F401  (before numba; see its docstring)
import numba
import numpy as np

from vllm_kvcodec.codecs.into_pages import pointer_to

BLOCK_PAIRS = 512  # pairs scanned per escape flag; one flag per 1024 values


@numba.njit(cache=True, nogil=True, boundscheck=False)
def encode_pairs_bf16(
    words: np.ndarray,  # uint32[n_pairs]: two bf16 values, first in the low half
    lut: np.ndarray,  # uint32[256]: exponent -> code | escape << 8 (dword entries gather well)
    codes: np.ndarray,  # uint8[n_pairs] out
    signman: np.ndarray,  # uint16[n_pairs] out, first value in the low byte
    block_flags: np.ndarray,  # uint8[ceil(n_pairs / BLOCK_PAIRS)] out
) -> None:
    n_pairs = words.shape[0]
    for b in range(block_flags.shape[0]):
        start = b * BLOCK_PAIRS
        stop = min(start + BLOCK_PAIRS, n_pairs)
        flag = np.uint32(0)
        for j in range(start, stop):
            w = words[j]
            c0 = lut[(w >> 7) & 0xFF]
            c1 = lut[(w >> 23) & 0xFF]
            codes[j] = np.uint8(((c0 & 15) << 4) | (c1 & 15))
            signman[j] = np.uint16(((w >> 8) & 0x80) | (w & 0x7F) | ((w >> 16) & 0x8000) | ((w >> 8) & 0x7F00))
            flag |= c0 | c1
        block_flags[b] = np.uint8(flag >> 8)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def gather_escapes_bf16(
    values: np.ndarray,  # uint16[n]
    is_escape: np.ndarray,
    block_flags: np.ndarray,
    positions: np.ndarray,  # uint32[n_escapes] out
    exponents: np.ndarray,  # uint8[n_escapes] out
) -> int:
    n = values.shape[0]
    k = 0
    for b in range(block_flags.shape[0]):
        if block_flags[b] == 0:
            continue
        start = b * 2 * BLOCK_PAIRS
        for i in range(start, min(start + 2 * BLOCK_PAIRS, n)):
            e = (values[i] >> 7) & 0xFF
            if is_escape[e]:
                if k < positions.shape[0]:
                    positions[k] = i
                    exponents[k] = e
                k += 1
    return k


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode_pairs_bf16(
    codes: np.ndarray,  # uint8[n_pairs]
    signman: np.ndarray,  # uint8[2 * n_pairs]
    pair_lut: np.ndarray,  # uint32[256]: code byte -> both exponents in place
    out: np.ndarray,  # uint32[n_pairs]
) -> None:
    for j in range(out.shape[0]):
        s = np.uint32(signman[2 * j]) | (np.uint32(signman[2 * j + 1]) << 8)
        out[j] = pair_lut[codes[j]] | ((s & 0x80) << 8) | (s & 0x7F) | ((s & 0x8000) << 16) | ((s & 0x7F00) << 8)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode_quads_bf16(
    codes: np.ndarray,  # uint32[q]: four code bytes (pairs 4i..4i+3), may be unaligned
    signman: np.ndarray,  # uint64[q]: eight sign-mantissa bytes, may be unaligned
    pair_lut: np.ndarray,
    out: np.ndarray,  # uint32[4q]
) -> None:
    """decode_pairs_bf16 four pairs at a time: wide loads, 19% faster measured."""
    for q in range(codes.shape[0]):
        c = codes[q]
        s = signman[q]
        for p in range(4):
            code = (c >> np.uint32(8 * p)) & np.uint32(0xFF)
            t = np.uint32((s >> np.uint64(16 * p)) & np.uint64(0xFFFF))
            out[4 * q + p] = pair_lut[code] | ((t & 0x80) << 8) | (t & 0x7F) | ((t & 0x8000) << 16) | ((t & 0x7F00) << 8)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def patch_escapes_bf16(out: np.ndarray, positions: np.ndarray, exponents: np.ndarray) -> bool:
    """Overwrite the exponent of each escape; False if positions are not strictly increasing in range."""
    n = out.shape[0]
    last = -1
    for k in range(positions.shape[0]):
        p = np.int64(positions[k])
        if p <= last or p >= n:
            return False
        last = p
        out[p] = (out[p] & np.uint16(0x807F)) | (np.uint16(exponents[k]) << 7)
    return True


@numba.njit(cache=True, nogil=True, boundscheck=False)
def patch_escapes_f32(out: np.ndarray, positions: np.ndarray, exponents: np.ndarray) -> bool:
    n = out.shape[0]
    last = -1
    for k in range(positions.shape[0]):
        p = np.int64(positions[k])
        if p <= last or p >= n:
            return False
        last = p
        out[p] = (out[p] & np.uint32(0x807FFFFF)) | (np.uint32(exponents[k]) << 23)
    return True


@numba.njit(cache=True, nogil=True, boundscheck=False)
def exponent_histogram_bf16(words: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Counts of the 256 exponents; four sub-tables hide store-to-load latency."""
    sub = np.zeros((4, 256), dtype=np.int64)
    n_pairs = words.shape[0]
    quads = n_pairs // 2
    for q in range(quads):
        w0 = words[2 * q]
        w1 = words[2 * q + 1]
        sub[0, (w0 >> 7) & 0xFF] += 1
        sub[1, (w0 >> 23) & 0xFF] += 1
        sub[2, (w1 >> 7) & 0xFF] += 1
        sub[3, (w1 >> 23) & 0xFF] += 1
    for j in range(2 * quads, n_pairs):
        sub[0, (words[j] >> 7) & 0xFF] += 1
        sub[1, (words[j] >> 23) & 0xFF] += 1
    for i in range(tail.shape[0]):
        sub[0, (tail[i] >> 7) & 0xFF] += 1
    return sub.sum(axis=0)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode_pairs_bf16_into(
    codes: np.ndarray,  # uint8[n_pairs]
    signman: np.ndarray,  # uint16[n_pairs]: the pair's two sign-mantissa bytes, first in the low byte
    pair_lut: np.ndarray,
    positions: np.ndarray,  # uint32[m]
    exponents: np.ndarray,  # uint8[m]
    addresses: np.ndarray,  # int64[e]: page extents (into_pages.PageExtents), 4-byte multiples summing to 4 n_pairs
    nbytes: np.ndarray,
) -> bool:
    """decode_pairs_bf16 and patch_escapes_bf16 straight into page extents; False, writing nothing, on bad escapes."""
    n = 2 * codes.shape[0]
    last = -1
    for k in range(positions.shape[0]):  # all checked before the first write into the pages
        p = np.int64(positions[k])
        if p <= last or p >= n:
            return False
        last = p
    words = np.empty(0, dtype=np.uint32)
    pair = 0
    for e in range(addresses.shape[0]):
        out = numba.carray(pointer_to(addresses[e], words), nbytes[e] // 4)
        w = out.shape[0]
        _decode_pairs(codes[pair : pair + w], signman[pair : pair + w], pair_lut, out)
        pair += w
    halves = np.empty(0, dtype=np.uint16)
    e, first = 0, 0  # the extent holding the escape, and its first value's index in the object
    for k in range(positions.shape[0]):
        p = np.int64(positions[k])
        while p >= first + nbytes[e] // 2:
            first += nbytes[e] // 2
            e += 1
        out16 = numba.carray(pointer_to(addresses[e], halves), nbytes[e] // 2)
        out16[p - first] = (out16[p - first] & np.uint16(0x807F)) | (np.uint16(exponents[k]) << 7)
    return True


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _decode_pairs(codes: np.ndarray, signman: np.ndarray, pair_lut: np.ndarray, out: np.ndarray) -> None:
    for j in range(out.shape[0]):
        t = np.uint32(signman[j])
        out[j] = pair_lut[codes[j]] | ((t & 0x80) << 8) | (t & 0x7F) | ((t & 0x8000) << 16) | ((t & 0x7F00) << 8)
