"""After NVDEC: join the decoded exponent pictures with the sign+mantissa bytes, and check them, on the device.

A ``video`` chunk's payload carries the XXH3-64 of its exponent bytes
(:mod:`vllm_kvcodec.codecs.video`): a stream that decodes, but not to the
encoded exponents (concealed corruption, a decoder bug), must fail its object
as it does on the CPU. Reading the exponents back to hash them on the host
would cost a device-to-host copy of ``n`` bytes per object; instead, as the
SplitZip decode does with its error flags, the device computes what the check
needs and the host reads a few bytes back together with the copy it already
waits for:

* ``_join``: one pass over the ``n`` values: the exponent byte from its
  picture (the layout's crop: row ``k // row``, column ``k % row``), the
  sign+mantissa byte, one bfloat16 (as int16) out.
* ``_xxh3_acc``: XXH3-64's long-input loop (inputs over 240 bytes) over the
  exponent bytes, read back out of the joined values (``(v >> 7) & 0xFF``):
  the eight 64-bit accumulators, one program, 1 KiB blocks in order (the
  scramble after each block makes the blocks sequential; within a block the 16
  stripes are summed at once). The host finishes the hash from those 64 bytes
  (:func:`finish_xxh3`: a 128-bit multiply-fold per accumulator pair, which
  Triton has no type for). Inputs of at most 240 bytes are copied back as they
  are (240 bytes) and hashed on the host.

The long-input algorithm is XXH3's reference (default secret, seed 0); the
tests compare it with the ``xxhash`` library for many lengths, the device
kernel in Triton's interpreter.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from vllm_kvcodec.errors import CodecError
from vllm_kvcodec.gpu.launch import Launcher, cdiv

#: XXH3's default 192-byte secret (xxhash.h, ``XXH3_kSecret``).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
MASK64 = (1 << 64) - 1
PRIME32_1, PRIME32_2, PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
PRIME64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
INIT_ACC = (PRIME32_3, PRIME64[0], PRIME64[1], PRIME64[2], PRIME64[3], PRIME32_2, PRIME64[4], PRIME32_1)
MIDSIZE_MAX = 240  # XXH3 hashes inputs up to this length without the accumulator loop
READBACK_BYTES = 256  # the accumulators (64 bytes), or a short input's bytes (<= 240)
JOIN_BLOCK = 2048
JOIN_WARPS = 4


def _word(buf: bytes, at: int) -> int:
    return struct.unpack_from("<Q", buf, at)[0]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _tables() -> torch.Tensor:
    """int64[152]: the per-stripe keys [16 x 8], the scramble key [8], the last-stripe key [8], the initial accs [8]."""
    keys = [_word(SECRET, 8 * (s + i)) for s in range(16) for i in range(8)]
    scramble = [_word(SECRET, 128 + 8 * i) for i in range(8)]
    last = [_word(SECRET, 121 + 8 * i) for i in range(8)]
    return torch.tensor([_signed(v) for v in (*keys, *scramble, *last, *INIT_ACC)], dtype=torch.int64)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _tables_on(device: torch.device) -> torch.Tensor:
    if device not in _TABLES:  # built once per device (first object on the main thread: see CudaPlacement.warm)
        _TABLES[device] = _tables().to(device)
    return _TABLES[device]


@triton.jit
def _join(planes_ptr, sm_ptr, out_ptr, n, row, width, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = k < n
    r = k // row
    e = tl.load(planes_ptr + r * width + (k - r * row), mask=live, other=0).to(tl.int32)
    s = tl.load(sm_ptr + k, mask=live, other=0).to(tl.int32)
    tl.store(out_ptr + k, (((s & 0x80) << 8) | (e << 7) | (s & 0x7F)).to(tl.int16), mask=live)


@triton.jit
def _words(ptr, base, OFFS, valid, EXPONENTS: tl.constexpr):
    """Little-endian u64 words at ``base + OFFS`` ([16, 8] offsets): of a byte buffer, or (``EXPONENTS``) of the
    exponent bytes of bfloat16 bits, one per int16 element (``(v >> 7) & 0xFF``)."""
    j = tl.arange(0, 8)
    b = tl.load(ptr + base + OFFS[:, :, None] + j[None, None, :], mask=valid[:, :, None], other=0)
    if EXPONENTS:
        e = ((b.to(tl.int32) >> 7) & 0xFF).to(tl.uint64)
    else:
        e = b.to(tl.uint64)
    return tl.sum(e << (8 * j[None, None, :]).to(tl.uint64), axis=2)


@triton.jit
def xxh3_long_acc(ptr, tab_ptr, start, length, EXPONENTS: tl.constexpr):
    """XXH3-64's eight accumulators after its long-input loop over ``length`` (> 240) bytes at ``start``.

    1 KiB blocks in order (the scramble after each makes them sequential;
    within a block the 16 stripes are summed at once), then the last partial
    block's whole stripes, then the input's final 64 bytes with the secret at
    offset 121. ``tab_ptr``: :func:`_tables`.
    """
    s = tl.arange(0, 16)
    i = tl.arange(0, 8)
    offs = s[:, None] * 64 + i[None, :] * 8  # [16, 8] word offsets inside a block
    swap = s[:, None] * 64 + (i[None, :] ^ 1) * 8  # acc[i] takes the word of lane i ^ 1
    keys = tl.load(tab_ptr + s[:, None] * 8 + i[None, :]).to(tl.uint64, bitcast=True)
    scr = tl.load(tab_ptr + 128 + i).to(tl.uint64, bitcast=True)
    last = tl.load(tab_ptr + 136 + i).to(tl.uint64, bitcast=True)
    acc = tl.load(tab_ptr + 144 + i).to(tl.uint64, bitcast=True)
    lo = tl.full([16, 8], 0xFFFFFFFF, tl.uint64)
    prime = tl.full([8], 0x9E3779B1, tl.uint64)
    every = offs >= 0
    nb = (length - 1) // 1024
    ns = ((length - 1) - 1024 * nb) // 64
    for blk in range(0, nb):
        base = start + blk * 1024
        w = _words(ptr, base, offs, every, EXPONENTS)
        ws = _words(ptr, base, swap, every, EXPONENTS)
        k = w ^ keys
        acc += tl.sum((k & lo) * (k >> 32), axis=0) + tl.sum(ws, axis=0)
        acc = ((acc ^ (acc >> 47)) ^ scr) * prime
    base = start + nb * 1024  # the last, partial block: its first ns stripes
    valid = (s < ns)[:, None] & every
    w = _words(ptr, base, offs, valid, EXPONENTS)
    ws = _words(ptr, base, swap, valid, EXPONENTS)
    k = w ^ keys
    acc += tl.sum(tl.where(valid, (k & lo) * (k >> 32), 0), axis=0) + tl.sum(ws, axis=0)
    lvalid = (s < 1)[:, None] & every  # the last stripe: the input's final 64 bytes, with the secret at offset 121
    base = start + length - 64
    w = tl.sum(tl.where(lvalid, _words(ptr, base, offs, lvalid, EXPONENTS), 0), axis=0)
    ws = tl.sum(tl.where(lvalid, _words(ptr, base, swap, lvalid, EXPONENTS), 0), axis=0)
    k = w ^ last
    acc += (k & tl.full([8], 0xFFFFFFFF, tl.uint64)) * (k >> 32) + ws
    return acc


@triton.jit
def _xxh3_acc(vals_ptr, tab_ptr, acc_ptr, n):
    acc = xxh3_long_acc(vals_ptr, tab_ptr, 0, n, True)
    tl.store(acc_ptr + tl.arange(0, 8), acc.to(tl.int64, bitcast=True))


def join_exponents(planes: torch.Tensor, signman: torch.Tensor, geo, out: torch.Tensor) -> None:
    """``out`` (int16, ``geo.n``) = bfloat16 bits from the cropped exponent pictures and the sign+mantissa bytes.

    ``planes``: contiguous ``[frames, 3, height, width]`` uint8 on the device;
    ``signman``: ``n`` uint8. Runs on the current stream.
    """
    want = (geo.frames, 3, geo.height, geo.width)
    if tuple(planes.shape) != want or planes.dtype != torch.uint8 or not planes.is_contiguous():
        raise CodecError(f"decoded pictures are {tuple(planes.shape)} {planes.dtype}, expected contiguous {want} uint8")
    if signman.numel() != geo.n or out.numel() != geo.n or out.dtype != torch.int16:
        raise CodecError(f"join needs {geo.n} sign+mantissa bytes and int16 outputs")
    if geo.n:
        Launcher(out.device)(_join, (cdiv(geo.n, JOIN_BLOCK),), planes, signman, out, geo.n, geo.row, geo.width,
                             BLOCK=JOIN_BLOCK, num_warps=JOIN_WARPS)


def exponent_digest_into(values: torch.Tensor, readback: torch.Tensor) -> None:
    """What :func:`finish_xxh3` needs about the exponent bytes of ``values`` (int16 bfloat16 bits), into ``readback``.

    ``readback``: a device uint8 tensor of :data:`READBACK_BYTES`. Runs on
    the current stream; no host synchronisation.
    """
    n = values.numel()
    if n <= MIDSIZE_MAX:
        readback[:n].copy_(((values >> 7) & 0xFF).to(torch.uint8))
        return
    acc = readback[:64].view(torch.int64)
    Launcher(values.device)(_xxh3_acc, (1,), values, _tables_on(values.device), acc, n, num_warps=4)


def finish_xxh3(readback: bytes | memoryview, n: int) -> int:
    """XXH3-64 (seed 0) of the ``n`` exponent bytes from what :func:`exponent_digest_into` left in ``readback``."""
    view = bytes(readback)
    if n <= MIDSIZE_MAX:
        import xxhash

        return xxhash.xxh3_64_intdigest(view[:n])
    acc = struct.unpack_from("<8Q", view)
    h = (n * PRIME64[0]) & MASK64
    for i in range(4):
        x = (acc[2 * i] ^ _word(SECRET, 11 + 16 * i)) * (acc[2 * i + 1] ^ _word(SECRET, 19 + 16 * i))
        h = (h + ((x & MASK64) ^ (x >> 64))) & MASK64
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & MASK64
    return h ^ (h >> 32)


__all__ = ["READBACK_BYTES", "exponent_digest_into", "finish_xxh3", "join_exponents"]
