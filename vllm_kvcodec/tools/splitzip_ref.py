"""Plain-numpy SplitZip (bfloat16 only): the payload of :mod:`vllm_kvcodec.codecs.splitzip`, byte for byte.

Slow and simple on purpose. It needs neither numba nor the codec registry, so
the GPU device check (``benchmarks/gpu_check.py``) can compare the Triton
kernels against it on a machine where only torch, triton and numpy exist. The
tests check that it produces exactly the CPU codec's bytes.
"""

from __future__ import annotations

import numpy as np

from vllm_kvcodec.errors import CodecError

CODEBOOK_SIZE = 16
HEADER_BYTES = CODEBOOK_SIZE + 4  # codebook, u32 escape count


def payload_size(n: int, m: int) -> int:
    """Bytes of a bfloat16 payload of ``n`` elements with ``m`` escapes."""
    return HEADER_BYTES + (n + 1) // 2 + n + 5 * m


def encode_bf16(bits: np.ndarray) -> bytes:
    """SplitZip payload of bfloat16 bit patterns (any shape; uint16 or int16)."""
    raw = np.ascontiguousarray(bits).reshape(-1).view(np.uint16)
    e = ((raw >> 7) & 0xFF).astype(np.intp)
    hist = np.bincount(e, minlength=256)
    codebook = np.argsort(-hist, kind="stable")[:CODEBOOK_SIZE].astype(np.uint8)
    code_of = np.full(256, 255, dtype=np.uint8)
    code_of[codebook] = np.arange(CODEBOOK_SIZE, dtype=np.uint8)
    codes4 = code_of[e]
    escape = codes4 == 255
    codes4[escape] = 0
    if codes4.size & 1:
        codes4 = np.append(codes4, np.uint8(0))
    codes = (codes4[0::2] << 4) | codes4[1::2]
    signman = (((raw >> 8) & 0x80) | (raw & 0x7F)).astype(np.uint8)
    positions = np.flatnonzero(escape).astype("<u4")
    exponents = e[positions].astype(np.uint8)
    return b"".join([
        codebook.tobytes(), np.uint32(positions.size).astype("<u4").tobytes(),
        codes.tobytes(), signman.tobytes(), positions.tobytes(), exponents.tobytes(),
    ])


def decode_bf16(payload: bytes | memoryview, n: int) -> np.ndarray:
    """Inverse of :func:`encode_bf16`: ``n`` uint16 bit patterns. Validates like the CPU codec."""
    buf = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
    if buf.size < HEADER_BYTES:
        raise CodecError(f"splitzip payload of {buf.size} bytes is shorter than its header")
    codebook = buf[:CODEBOOK_SIZE]
    m = int(buf[16:20].view("<u4")[0])
    if m > n or buf.size != payload_size(n, m):
        raise CodecError(f"splitzip payload of {buf.size} bytes does not fit n={n}, m={m}")
    h = (n + 1) // 2
    codes = buf[HEADER_BYTES : HEADER_BYTES + h]
    signman = buf[HEADER_BYTES + h : HEADER_BYTES + h + n].astype(np.uint16)
    at = HEADER_BYTES + h + n
    positions = buf[at : at + 4 * m].view("<u4").astype(np.int64)
    exponents = buf[at + 4 * m :].astype(np.uint16)
    nib = np.empty(2 * h, dtype=np.uint8)
    nib[0::2], nib[1::2] = codes >> 4, codes & 15
    e = codebook[nib[:n]].astype(np.uint16)
    if m and (positions[-1] >= n or np.any(np.diff(positions) <= 0)):
        raise CodecError("splitzip escape positions are out of range or not strictly increasing")
    e[positions] = exponents
    return ((signman & 0x80) << 8) | (e << 7) | (signman & 0x7F)
