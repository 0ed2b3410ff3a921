"""The chunk format's value digest (flag ``VALUE_DIGEST``) on the device: one XXH3-64 per segment, all at once.

A decoder on the device (NVDEC + the join, the SplitZip kernels) must prove
its output equals what was encoded before anything is scattered. A whole-input
XXH3-64 is one sequential walk (each 1 KiB block's scramble feeds the next):
on one GPU program that is about 3-6 ms for a 256-token chunk, far slower
than NVDEC decodes it. The value digest (docs/format.md) cuts the values'
bytes into segments hashed independently: here one program per segment runs
XXH3-64's long-input loop over its segment and finishes it (the 128-bit
multiply-fold from 32-bit halves), writing one u64; the host hashes that list
(``nseg * 8`` bytes) and compares. Segment boundaries follow
:func:`vllm_kvcodec.format.digest_segments` (every segment of a multi-segment
digest is longer than 240 bytes, so every program takes the long path); a
single input of at most 240 bytes is copied back as it is and hashed on the host.

Device plumbing only: the segment size comes from the caller (the chunk's
header, read in :mod:`vllm_kvcodec.format.device_chunks`); tests compare the result
with the CPU definition in Triton's interpreter for many lengths and segments.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from vllm_kvcodec.gpu.launch import Launcher
from vllm_kvcodec.gpu.nvdec_join_triton import MIDSIZE_MAX, SECRET, _tables_on, xxh3_long_acc

SEGMENT_WARPS = 4


def segment_count(nbytes: int, segment: int) -> int:
    """How many segments ``nbytes`` bytes form (as :func:`vllm_kvcodec.format.digest_segments` cuts them)."""
    count = max(1, -(-nbytes // segment))
    if count > 1 and nbytes - (count - 1) * segment <= MIDSIZE_MAX:
        count -= 1
    return count


def readback_bytes(nbytes: int, segment: int) -> int:
    """Bytes the host reads back to finish the digest of ``nbytes`` bytes."""
    return nbytes if nbytes <= MIDSIZE_MAX else 8 * segment_count(nbytes, segment)


@triton.jit
def _fold(a, b):
    """The 128-bit product of two u64 values, its low and high halves XORed (XXH3's mul128_fold64)."""
    m = 0xFFFFFFFF
    a_lo, a_hi, b_lo, b_hi = a & m, a >> 32, b & m, b >> 32
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> 32) + (hi_lo & m) + lo_hi
    upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
    lower = (cross << 32) | (lo_lo & m)
    return lower ^ upper


@triton.jit
def _lane(acc, i, k):
    return tl.sum(tl.where(i == k, acc, 0), axis=0)


@triton.jit
def _segment_xxh3(data_ptr, tab_ptr, merge_ptr, out_ptr, nbytes, nseg, SEGMENT: tl.constexpr):
    seg = tl.program_id(0)
    start = seg.to(tl.int64) * SEGMENT
    length = tl.where(seg == nseg - 1, nbytes - start, SEGMENT)
    acc = xxh3_long_acc(data_ptr, tab_ptr, start, length, False)
    i = tl.arange(0, 8)
    keyed = acc ^ tl.load(merge_ptr + i).to(tl.uint64, bitcast=True)  # acc[j] ^ secret word for lane j (merge)
    h = length.to(tl.uint64) * 0x9E3779B185EBCA87
    h += _fold(_lane(keyed, i, 0), _lane(keyed, i, 1))
    h += _fold(_lane(keyed, i, 2), _lane(keyed, i, 3))
    h += _fold(_lane(keyed, i, 4), _lane(keyed, i, 5))
    h += _fold(_lane(keyed, i, 6), _lane(keyed, i, 7))
    h ^= h >> 37
    h *= 0x165667919E3779F9
    h ^= h >> 32
    tl.store(out_ptr + seg, h.to(tl.int64, bitcast=True))


def _merge_words() -> torch.Tensor:
    """int64[8]: the secret words mergeAccs XORs into accumulator j (offsets 11 + 8j)."""
    words = [struct.unpack_from("<Q", SECRET, 11 + 8 * j)[0] for j in range(8)]
    return torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words], dtype=torch.int64)


_MERGE: dict[torch.device, torch.Tensor] = {}


def _merge_on(device: torch.device) -> torch.Tensor:
    if device not in _MERGE:
        _MERGE[device] = _merge_words().to(device)
    return _MERGE[device]


def value_digest_into(data: torch.Tensor, segment: int, readback: torch.Tensor) -> None:
    """What :func:`finish_value_digest` needs about ``data`` (a contiguous device byte tensor), into ``readback``.

    ``readback``: a device uint8 tensor of at least :func:`readback_bytes`.
    Runs on the current stream; no host synchronisation.
    """
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError("the value digest hashes a contiguous 1-D uint8 tensor")
    n = data.numel()
    if n <= MIDSIZE_MAX:
        readback[:n].copy_(data)
        return
    count = segment_count(n, segment)
    out = readback[: 8 * count].view(torch.int64)
    Launcher(data.device)(_segment_xxh3, (count,), data, _tables_on(data.device), _merge_on(data.device), out, n,
                          count, SEGMENT=segment, num_warps=SEGMENT_WARPS)


def finish_value_digest(readback: bytes | memoryview, nbytes: int, segment: int) -> int:
    """The value digest (docs/format.md) of ``nbytes`` bytes from what :func:`value_digest_into` left in ``readback``."""
    import xxhash

    view = bytes(memoryview(readback).cast("B")[: readback_bytes(nbytes, segment)])
    if nbytes <= MIDSIZE_MAX:
        return xxhash.xxh3_64_intdigest(struct.pack("<Q", xxhash.xxh3_64_intdigest(view)))
    return xxhash.xxh3_64_intdigest(view)

__all__ = ["finish_value_digest", "readback_bytes", "segment_count", "value_digest_into"]
