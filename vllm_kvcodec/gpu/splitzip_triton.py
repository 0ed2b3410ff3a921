"""SplitZip for bfloat16 in Triton: the CPU codec's payload, byte for byte, made and read on the device.

Payload: exactly :mod:`vllm_kvcodec.codecs.splitzip`'s (codebook, u32 escape
count ``m``, ``ceil(n/2)`` code bytes, ``n`` sign+mantissa bytes, ``m`` u32
escape positions, ``m`` exponents). The codebook is chosen with the same rule
(most frequent first, ties to the smaller exponent) from the exact histogram,
so a GPU-encoded payload *is* the CPU-encoded one, and a chunk keeps the codec
id ``"splitzip"``: either side decodes the other's chunks.

Values are handled in pairs, as the CPU kernels do: the input is read as
32-bit words (values ``2j`` and ``2j+1``), each word yields one code byte (first
value in the high nibble) and one 16-bit sign+mantissa word, and decode writes
32-bit words. An odd last value is handled by a one-program tail kernel.

Encode (one host synchronisation)
    1. ``_hist``: exponent histogram. A persistent grid; each program
       accumulates private histograms over its tiles and adds them into a
       global ``int64[256]`` with relaxed atomics, once per bin. ``hist="full"``
       is ``tl.histogram`` over 256 bins. ``hist="window"`` (default) is
       ``tl.histogram`` over 64 bins: bin 0 for exponent 0, bins 1..62 for
       exponents 96..157 (``|x|`` in [2**-31, 2**30): all KV we have seen),
       bin 63 for anything else; a tile whose bin 63 is not empty also runs a
       256-bin ``tl.histogram`` over just those values (rare on KV, every tile
       on random bits). Both are exact. Triton 3.6 lowers ``tl.histogram`` to
       per-bit warp ballots, whose work grows with the bin count: its SASS loop
       is 2.08 warp instructions per value for 256 bins, 1.53 for the window
       (the pass is compute-bound there, about 1 TB/s of input on an H200).
       Triton 3.9 lowers it to shared-memory atomics: 0.22 and 0.38, both
       under the memory roofline.
    2. ``_codebook`` (one program): rank of every exponent among the 256 counts
       (count descending, exponent ascending: the CPU codec's stable argsort),
       the 16-byte codebook, the ``exponent -> code`` table (16 = escape),
       ``m`` and the 20-byte header.
    3. host: ``m.item()`` -- the one synchronisation, to size the payload.
    4. ``_encode`` (one program per ``tile`` pairs, in steps of ``sub`` pairs):
       code bytes and sign+mantissa words, the tile's escape count, and its
       first ``cap`` escapes (position, exponent) in a per-tile scratch slot.
       The compaction (a ``tl.cumsum`` over the step) runs only in steps that
       hold an escape (about 1 in 4 on real KV at ``sub=256``). Program 0 writes
       the header. The payload buffer is placed so the sign+mantissa stream
       starts 16-byte aligned (the code stream too whenever ``ceil(n/2)`` is a
       multiple of 16, as for any real chunk), so every stream access vectorises.
    5. ``torch.cumsum`` of the tile counts, then ``_scatter``: copies each
       tile's scratch escapes to their final place; a tile with more than
       ``cap`` escapes re-reads its values and compacts them directly (so
       escape-heavy data is slower, never wrong). Positions stay strictly
       increasing because tiles, steps and pairs are compacted in order.

Decode (no synchronisation needed to run)
    Sizes are validated on the host before anything is launched: the payload
    length must be ``20 + ceil(n/2) + n + 5 m`` for an integer ``0 <= m <= n``
    (``m`` follows from the length; a bytes payload's stored ``m`` is checked on
    the host too). ``_decode`` rebuilds every pair from its code byte and
    sign+mantissa word (program 0 also checks a device payload's stored ``m``
    against the size); ``_patch`` overwrites the exponent of each escape.
    Escape positions are untrusted: ``_patch`` writes only positions ``< n``
    (never out of bounds) and sets a device error flag when a position is
    ``>= n`` or not greater than its predecessor. :func:`decode_splitzip_gpu`
    reads the flags once at the end (one host synchronisation) and raises
    :class:`~vllm_kvcodec.errors.CodecError`; :func:`decode_splitzip_gpu_async`
    returns them instead, to be checked later with :func:`raise_if_invalid`
    (the output must not be used before that).

Kernels on CPU tensors run in Triton's interpreter (tests, ``--dry-run``),
which needs ``TRITON_INTERPRET=1`` in the environment before triton is first
imported in the process (triton's own library functions are decorated at
import); the tests therefore run the kernels in a child process.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from vllm_kvcodec.errors import CodecError, ConfigError, UnsupportedDTypeError
from vllm_kvcodec.gpu.launch import Launcher, can_run_on, cdiv, interpreted, resolve_device

CODEBOOK_SIZE = 16
HEADER_BYTES = 20  # 16-byte codebook + u32 escape count
MAX_ELEMENTS = 1 << 31  # positions are u32 and kernel element offsets int32 (format.MAX_ELEMENTS too)

ENCODE_TILE = 4096  # pairs (32-bit words, two values) per _encode program
ENCODE_SUB = 256  # pairs per inner step of _encode (escape compaction runs only in steps that have one)
ENCODE_WARPS = 1  # 8 words (1 KB) per warp per step, ~0.8 warp instructions per value (docs/gpu.md)
DECODE_PAIRS = 2048  # pairs per _decode program
DECODE_WARPS = 8
CAP = 64  # escapes per encode tile kept on the scratch fast path
TILES_PER_SCATTER = 32  # encode tiles per _scatter program
HIST_BLOCK = 4096  # values per _hist iteration
PATCH_BLOCK = 1024  # escapes per _patch program
HIST_MODES = ("window", "full")
WINDOW_BASE = 96  # hist="window": bins 1..62 are exponents 96..157; bin 0 is exponent 0, bin 63 the rest

# Error flags written by the decode kernels.
ERR_ESCAPE_COUNT = 0  # stored m differs from the one the payload length implies
ERR_POSITIONS = 1  # an escape position is >= n or not strictly increasing


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _hist(x_ptr, hist_ptr, n, num_tiles, BLOCK: tl.constexpr, WINDOW: tl.constexpr, BASE: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    full = tl.zeros([256], dtype=tl.int64)
    win = tl.zeros([64], dtype=tl.int64)
    bins64 = tl.arange(0, 64)
    for t in range(pid, num_tiles, num_programs):
        offs = t * BLOCK + lane
        valid = offs < n
        v = tl.load(x_ptr + offs, mask=valid, other=0).to(tl.int32)
        e = (v >> 7) & 0xFF
        if WINDOW:
            # bin 0: exponent 0; bins 1..62: exponents BASE..BASE+61; bin 63: anything else
            rel = e - BASE
            key = tl.where(e == 0, 0, tl.where((rel >= 0) & (rel < 62), rel + 1, 63))
            h = tl.histogram(key, 64, mask=valid)
            win += h.to(tl.int64)
            if tl.sum(tl.where(bins64 == 63, h, 0), axis=0) > 0:  # rare on KV: count those exactly
                full += tl.histogram(e, 256, mask=valid & (key == 63)).to(tl.int64)
        else:
            full += tl.histogram(e, 256, mask=valid).to(tl.int64)
    if WINDOW:
        tl.atomic_add(hist_ptr + tl.where(bins64 == 0, 0, BASE + bins64 - 1), win, mask=bins64 < 63, sem="relaxed")
    tl.atomic_add(hist_ptr + tl.arange(0, 256), full, sem="relaxed")


@triton.jit
def _codebook(hist_ptr, table_ptr, meta_ptr, m_ptr, n, ROWS: tl.constexpr):
    cols = tl.arange(0, 256)
    hc = tl.load(hist_ptr + cols)
    covered = tl.zeros([ROWS], dtype=tl.int64)
    for r0 in tl.static_range(0, 256, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        hr = tl.load(hist_ptr + rows)
        beats = (hc[None, :] > hr[:, None]) | ((hc[None, :] == hr[:, None]) & (cols[None, :] < rows[:, None]))
        rank = tl.sum(beats.to(tl.int32), axis=1)
        chosen = rank < 16
        tl.store(table_ptr + rows, tl.where(chosen, rank, 16))
        tl.store(meta_ptr + rank, rows.to(tl.uint8), mask=chosen)
        covered += tl.where(chosen, hr, 0)
    m = n - tl.sum(covered, axis=0)
    tl.store(m_ptr, m)
    b = tl.arange(0, 4)
    tl.store(meta_ptr + 16 + b, ((m >> (8 * b)) & 0xFF).to(tl.uint8))


@triton.jit
def _encode(xw_ptr, table_ptr, meta_ptr, hdr_ptr, codes_ptr, smw_ptr, counts_ptr, spos_ptr, sexp_ptr,
            half, TILE: tl.constexpr, SUB: tl.constexpr, CAP: tl.constexpr):
    # One program: TILE pairs (32-bit words holding values 2j and 2j+1), in chunks of SUB.
    pid = tl.program_id(0)
    lane = tl.arange(0, SUB)
    run = pid * 0  # escapes seen so far in this tile
    for s in range(0, TILE, SUB):
        j = pid * TILE + s + lane
        live = j < half
        w = tl.load(xw_ptr + j, mask=live, other=0)
        e0 = (w >> 7) & 0xFF
        e1 = (w >> 23) & 0xFF
        t0 = tl.load(table_ptr + e0)
        t1 = tl.load(table_ptr + e1)
        x0 = (t0 > 15) & live
        x1 = (t1 > 15) & live
        code = (tl.where(t0 > 15, 0, t0) << 4) | tl.where(t1 > 15, 0, t1)
        tl.store(codes_ptr + j, code.to(tl.uint8), mask=live)
        sm = ((w >> 8) & 0x80) | (w & 0x7F) | ((w >> 16) & 0x8000) | ((w >> 8) & 0x7F00)
        tl.store(smw_ptr + j, sm.to(tl.int16), mask=live)
        f0 = x0.to(tl.int32)
        c = f0 + x1.to(tl.int32)
        cnt = tl.sum(c, axis=0)
        if cnt > 0:  # rare on KV: compact this chunk's escapes into the tile's scratch slot
            l0 = run + tl.cumsum(c, axis=0) - c
            l1 = l0 + f0
            k0 = x0 & (l0 < CAP)
            k1 = x1 & (l1 < CAP)
            tl.store(spos_ptr + pid * CAP + l0, 2 * j, mask=k0)
            tl.store(sexp_ptr + pid * CAP + l0, e0.to(tl.uint8), mask=k0)
            tl.store(spos_ptr + pid * CAP + l1, 2 * j + 1, mask=k1)
            tl.store(sexp_ptr + pid * CAP + l1, e1.to(tl.uint8), mask=k1)
        run += cnt
    tl.store(counts_ptr + pid, run)
    h = tl.arange(0, 32)
    first = h < tl.where(pid == 0, 20, 0)  # (vector & pid==0) trips the interpreter
    tl.store(hdr_ptr + h, tl.load(meta_ptr + h, mask=first, other=0), mask=first)


@triton.jit
def _encode_tail(x_ptr, table_ptr, meta_ptr, pay_ptr, code_off, sm_off, pos_off, exp_off, last):
    # Odd n: the last value (index ``last``) alone; its pair's low nibble is 0. Also writes the header.
    k = tl.arange(0, 4)
    first = k < 1
    v = tl.load(x_ptr + last + k, mask=first, other=0).to(tl.int32)
    e = (v >> 7) & 0xFF
    t = tl.load(table_ptr + e)
    escape = first & (t > 15)
    tl.store(pay_ptr + code_off + k, (tl.where(t > 15, 0, t) << 4).to(tl.uint8), mask=first)
    tl.store(pay_ptr + sm_off + k, (((v >> 8) & 0x80) | (v & 0x7F)).to(tl.uint8), mask=first)
    is_escape = tl.sum(escape.to(tl.int32), axis=0) > 0
    tl.store(pay_ptr + pos_off + k, ((last >> (8 * k)) & 0xFF).to(tl.uint8), mask=k < tl.where(is_escape, 4, 0))
    tl.store(pay_ptr + exp_off + k, e.to(tl.uint8), mask=escape)
    h = tl.arange(0, 32)
    tl.store(pay_ptr + h, tl.load(meta_ptr + h, mask=h < 20, other=0), mask=h < 20)


@triton.jit
def _scatter(xw_ptr, table_ptr, counts_ptr, incl_ptr, spos_ptr, sexp_ptr, pos_ptr, exp_ptr, half, num_tiles,
             TILE: tl.constexpr, SUB: tl.constexpr, CAP: tl.constexpr, TPP: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * TPP + tl.arange(0, TPP)
    alive = r < num_tiles
    cnt = tl.load(counts_ptr + r, mask=alive, other=0)
    start = tl.load(incl_ptr + r, mask=alive, other=0) - cnt
    c = tl.arange(0, CAP)
    fast = (c[None, :] < cnt[:, None]) & (cnt[:, None] <= CAP)
    src = r[:, None] * CAP + c[None, :]
    p = tl.load(spos_ptr + src, mask=fast, other=0)
    ex = tl.load(sexp_ptr + src, mask=fast, other=0)
    dst = start[:, None] + c[None, :]
    for b in tl.static_range(4):
        tl.store(pos_ptr + dst * 4 + b, ((p >> (8 * b)) & 0xFF).to(tl.uint8), mask=fast)
    tl.store(exp_ptr + dst, ex, mask=fast)
    overflowing = tl.sum((cnt > CAP).to(tl.int32), axis=0)
    if overflowing > 0:  # escape-heavy tiles: re-read the values and compact them here
        lane = tl.arange(0, SUB)
        for i in range(TPP):
            tile = pid * TPP + i
            ct = tl.load(counts_ptr + tile, mask=tile < num_tiles, other=0)
            if ct > CAP:
                run = tl.load(incl_ptr + tile) - ct
                for s in range(0, TILE, SUB):
                    j = tile * TILE + s + lane
                    live = j < half
                    w = tl.load(xw_ptr + j, mask=live, other=0)
                    e0 = (w >> 7) & 0xFF
                    e1 = (w >> 23) & 0xFF
                    x0 = (tl.load(table_ptr + e0) > 15) & live
                    x1 = (tl.load(table_ptr + e1) > 15) & live
                    f0 = x0.to(tl.int32)
                    cc = f0 + x1.to(tl.int32)
                    d0 = run + tl.cumsum(cc, axis=0) - cc
                    d1 = d0 + f0
                    for b in tl.static_range(4):
                        tl.store(pos_ptr + d0 * 4 + b, (((2 * j) >> (8 * b)) & 0xFF).to(tl.uint8), mask=x0)
                        tl.store(pos_ptr + d1 * 4 + b, (((2 * j + 1) >> (8 * b)) & 0xFF).to(tl.uint8), mask=x1)
                    tl.store(exp_ptr + d0, e0.to(tl.uint8), mask=x0)
                    tl.store(exp_ptr + d1, e1.to(tl.uint8), mask=x1)
                    run += tl.sum(cc, axis=0)


@triton.jit
def _decode(pay_ptr, codes_ptr, smw_ptr, outw_ptr, err_ptr, half, m, BP: tl.constexpr):
    pid = tl.program_id(0)
    j = pid * BP + tl.arange(0, BP)
    live = j < half
    c = tl.load(codes_ptr + j, mask=live, other=0).to(tl.int32)
    e0 = tl.load(pay_ptr + (c >> 4)).to(tl.int32)
    e1 = tl.load(pay_ptr + (c & 15)).to(tl.int32)
    s = tl.load(smw_ptr + j, mask=live, other=0).to(tl.int32)
    w = (((s & 0x80) << 8) | (e0 << 7) | (s & 0x7F)
         | ((s & 0x8000) << 16) | (e1 << 23) | ((s & 0x7F00) << 8))
    tl.store(outw_ptr + j, w, mask=live)
    b = tl.arange(0, 4)
    hb = tl.load(pay_ptr + 16 + b, mask=b < tl.where(pid == 0, 4, 0), other=0).to(tl.int64)
    stored = tl.sum(hb << (8 * b), axis=0)
    tl.store(err_ptr + 0, 1, mask=(stored != m) & (pid == 0))


@triton.jit
def _decode_tail(pay_ptr, out_ptr, err_ptr, code_off, sm_off, last, m):
    # Odd n: the last value from the high nibble of the last code byte; also checks the stored m.
    k = tl.arange(0, 4)
    first = k < 1
    c = tl.load(pay_ptr + code_off + k, mask=first, other=0).to(tl.int32)
    e = tl.load(pay_ptr + (c >> 4)).to(tl.int32)
    s = tl.load(pay_ptr + sm_off + k, mask=first, other=0).to(tl.int32)
    tl.store(out_ptr + last + k, (((s & 0x80) << 8) | (e << 7) | (s & 0x7F)).to(tl.int16), mask=first)
    stored = tl.sum(tl.load(pay_ptr + 16 + k).to(tl.int64) << (8 * k), axis=0)
    tl.store(err_ptr + 0, 1, mask=stored != m)


@triton.jit
def _patch(pos_ptr, exp_ptr, out_ptr, err_ptr, n, m, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    k = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = k < m
    has_prev = live & (k > 0)
    p = tl.zeros([BLOCK], dtype=tl.int64)
    prev = tl.zeros([BLOCK], dtype=tl.int64)
    for b in tl.static_range(4):
        p |= tl.load(pos_ptr + 4 * k + b, mask=live, other=0).to(tl.int64) << (8 * b)
        prev |= tl.load(pos_ptr + 4 * (k - 1) + b, mask=has_prev, other=0).to(tl.int64) << (8 * b)
    prev = tl.where(has_prev, prev, -1)
    bad = live & ((p <= prev) | (p >= n))
    tl.store(err_ptr + 1 + 0 * k, tl.full([BLOCK], 1, tl.int32), mask=bad)
    write = live & (p < n)
    ex = tl.load(exp_ptr + k, mask=live, other=0).to(tl.int32)
    old = tl.load(out_ptr + p, mask=write, other=0).to(tl.int32)
    tl.store(out_ptr + p, ((old & 0x807F) | (ex << 7)).to(tl.int16), mask=write)


_Launcher = Launcher  # the name gpu_check.py and older callers use
_cdiv = cdiv


def _check_pow2(name: str, value: int, low: int) -> None:
    if type(value) is not int or value < low or value & (value - 1):
        raise ConfigError(f"{name} must be a power of two >= {low}, got {value!r}")


def _aligned_empty(nbytes: int, align_at: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` whose byte ``align_at`` sits on a 16-byte boundary."""
    base = torch.empty(nbytes + 16, dtype=torch.uint8, device=device)
    shift = (-(base.data_ptr() + align_at)) % 16
    return base[shift : shift + nbytes]


def device_payload_buffer(nbytes: int, n: int, device: torch.device) -> torch.Tensor:
    """A device buffer for an ``nbytes`` payload of ``n`` values, its sign/mantissa stream on a 16-byte boundary.

    The decode kernel reads that stream with 16-byte vector loads; a payload
    copied into this buffer decodes at full width wherever it came from.
    """
    return _aligned_empty(nbytes, HEADER_BYTES + (n + 1) // 2, device)


def payload_size(n: int, m: int) -> int:
    """Bytes of a bfloat16 SplitZip payload of ``n`` values with ``m`` escapes."""
    return HEADER_BYTES + (n + 1) // 2 + n + 5 * m


# --------------------------------------------------------------------------------------
# Encode
# --------------------------------------------------------------------------------------


def encode_splitzip_gpu(
    x: torch.Tensor,
    *,
    hist: str = "window",
    tile: int = ENCODE_TILE,
    sub: int = ENCODE_SUB,
    cap: int = CAP,
    tiles_per_scatter: int = TILES_PER_SCATTER,
    hist_programs: int | None = None,
    num_warps: int = ENCODE_WARPS,
) -> torch.Tensor:
    """SplitZip payload of a contiguous bfloat16 tensor, as a uint8 tensor on ``x.device``.

    The bytes equal the CPU codec's payload for the same values
    (``SplitZipCodec().encode``). One host synchronisation (the escape count,
    to size the payload). ``bytes(payload.cpu().numpy())`` gives host bytes.
    The keyword arguments tune the kernels (``tile``/``sub``: pairs per program
    and per inner step; ``cap``: escapes per tile on the fast path); none of
    them changes a byte of the output.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise UnsupportedDTypeError(f"GPU SplitZip encodes bfloat16 tensors, got {getattr(x, 'dtype', type(x))}")
    if not x.is_contiguous():
        raise ConfigError("GPU SplitZip needs a contiguous tensor (call .contiguous() first)")
    if hist not in HIST_MODES:
        raise ConfigError(f"hist must be one of {HIST_MODES}, got {hist!r}")
    _check_pow2("sub", sub, 16)
    _check_pow2("tile", tile, sub)
    _check_pow2("cap", cap, 16)
    _check_pow2("tiles_per_scatter", tiles_per_scatter, 1)
    n = x.numel()
    if n > MAX_ELEMENTS:
        raise ConfigError(f"{n} values exceed the {MAX_ELEMENTS} a SplitZip chunk may hold")
    device = x.device
    if n == 0:
        head = np.arange(CODEBOOK_SIZE, dtype=np.uint8).tobytes() + struct.pack("<I", 0)
        return torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    run = _Launcher(device)
    flat = x.reshape(-1).view(torch.int16)
    if flat.data_ptr() % 4:  # pairs are read as 32-bit words
        flat = flat.clone()
    half, odd = n // 2, n & 1

    table, meta, m_dev = _codebook_on_device(run, flat, hist, hist_programs)
    m = int(m_dev.item())  # the one host synchronisation
    if not 0 <= m <= n:
        raise CodecError(f"internal error: escape count {m} outside [0, {n}]")

    h = (n + 1) // 2
    sm_at = HEADER_BYTES + h
    pos_at = sm_at + n
    exp_at = pos_at + 4 * m
    payload = _aligned_empty(payload_size(n, m), sm_at, device)
    if half:
        xw = flat[: 2 * half].view(torch.int32)
        codes = payload[HEADER_BYTES : HEADER_BYTES + half]
        smw = payload[sm_at : sm_at + 2 * half].view(torch.int16)
        tiles = _cdiv(half, tile)
        counts = torch.empty(tiles, dtype=torch.int32, device=device)
        spos = torch.empty(tiles * cap, dtype=torch.int32, device=device)
        sexp = torch.empty(tiles * cap, dtype=torch.uint8, device=device)
        run(_encode, (tiles,), xw, table, meta, payload, codes, smw, counts, spos, sexp, half,
            TILE=tile, SUB=sub, CAP=cap, num_warps=num_warps)
    if odd:  # the last value alone (it is the last escape, if it is one); also writes the header
        run(_encode_tail, (1,), flat, table, meta, payload, HEADER_BYTES + half, sm_at + n - 1,
            pos_at + 4 * (m - 1), exp_at + m - 1, n - 1, num_warps=1)
    if half and m:
        incl = torch.cumsum(counts, 0, dtype=torch.int64)
        run(_scatter, (_cdiv(tiles, tiles_per_scatter),), xw, table, counts, incl, spos, sexp,
            payload[pos_at:exp_at], payload[exp_at:], half, tiles,
            TILE=tile, SUB=sub, CAP=cap, TPP=tiles_per_scatter, num_warps=4)
    return payload


def _codebook_on_device(run: _Launcher, flat: torch.Tensor, hist: str,
                        hist_programs: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Histogram + codebook kernels: (code table int32[256], header bytes uint8[20], m int64[1]), no sync."""
    device, n = flat.device, flat.numel()
    counts256 = torch.zeros(256, dtype=torch.int64, device=device)
    table = torch.empty(256, dtype=torch.int32, device=device)
    meta = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
    m_dev = torch.empty(1, dtype=torch.int64, device=device)
    hist_tiles = _cdiv(n, HIST_BLOCK)
    if hist_programs is None:
        hist_programs = 4 * _num_sms(device) if device.type == "cuda" else 4
    run(_hist, (max(1, min(hist_tiles, hist_programs)),), flat, counts256, n, hist_tiles,
        BLOCK=HIST_BLOCK, WINDOW=hist == "window", BASE=WINDOW_BASE, num_warps=8)
    run(_codebook, (1,), counts256, table, meta, m_dev, n, ROWS=32, num_warps=4)
    return table, meta, m_dev


def codebook_gpu(x: torch.Tensor, *, hist: str = "window", hist_programs: int | None = None) -> tuple[bytes, int]:
    """The 16-byte codebook and escape count the encoder would choose for ``x`` (one sync)."""
    flat = x.reshape(-1).view(torch.int16)
    _, meta, m_dev = _codebook_on_device(_Launcher(x.device), flat, hist, hist_programs)
    return meta[:CODEBOOK_SIZE].cpu().numpy().tobytes(), int(m_dev.item())


def encode_splitzip_gpu_bytes(x: torch.Tensor, **options: Any) -> bytes:
    """:func:`encode_splitzip_gpu`, copied to host bytes."""
    return encode_splitzip_gpu(x, **options).cpu().numpy().tobytes()


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# --------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------


def _escape_count_from_size(length: int, n: int) -> int:
    rest = length - HEADER_BYTES - (n + 1) // 2 - n
    if rest < 0 or rest % 5:
        raise CodecError(
            f"splitzip payload of {length} bytes cannot hold {n} bfloat16 values "
            f"(needs {payload_size(n, 0)} + 5 per escape)"
        )
    m = rest // 5
    if m > n:
        raise CodecError(f"splitzip escape count {m} is outside [0, {n}]")
    return m


def decode_splitzip_gpu_async(
    payload: torch.Tensor | bytes | bytearray | memoryview,
    n: int,
    out: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    block_pairs: int = DECODE_PAIRS,
    num_warps: int = DECODE_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode without a host synchronisation: ``(out, error_flags)``.

    ``out`` holds the values only once ``raise_if_invalid(error_flags)`` has
    passed (it reads the flags: that is the synchronisation). Every size is
    validated here, before any kernel runs; a payload that fails raises
    :class:`CodecError` without touching ``out``.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ConfigError(f"n must be an int, got {type(n).__name__}")
    n = int(n)
    if not 0 <= n <= MAX_ELEMENTS:
        raise CodecError(f"element count {n} outside [0, {MAX_ELEMENTS}]")
    _check_pow2("block_pairs", block_pairs, 16)
    h = (n + 1) // 2
    sm_at = HEADER_BYTES + h
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise ConfigError("a device payload must be a contiguous 1-D uint8 tensor")
        dev = payload.device if device is None else resolve_device(device)
        if dev != payload.device:
            raise ConfigError(f"payload is on {payload.device}, decode asked for {dev}")
        m = _escape_count_from_size(payload.numel(), n)
        data = payload
        if (data.data_ptr() + sm_at) % 2:  # the sign+mantissa stream is read as 16-bit words
            data = _aligned_empty(payload.numel(), sm_at, dev)
            data.copy_(payload)
    else:
        view = memoryview(payload).cast("B")
        m = _escape_count_from_size(len(view), n)
        stored = struct.unpack_from("<I", view, CODEBOOK_SIZE)[0]
        if stored != m:
            raise CodecError(f"splitzip escape count {stored} disagrees with the payload size ({m})")
        dev = resolve_device(device if device is not None else (out.device if out is not None else "cuda"))
        data = _aligned_empty(len(view), sm_at, dev)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: it is only read
            data.copy_(torch.frombuffer(view, dtype=torch.uint8))
    target = out
    if out is None:
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    elif (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.bfloat16
        or out.numel() != n
        or out.device != dev
        or not out.is_contiguous()
    ):
        raise ConfigError(f"out must be a contiguous bfloat16 tensor of {n} values on {dev}")
    elif out.data_ptr() % 4:  # decoded as 32-bit words: go through an aligned buffer
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    err = torch.zeros(2, dtype=torch.int32, device=dev)
    if n == 0:  # nothing to decode; a device payload's stored count is read back (20 bytes)
        if struct.unpack("<I", data[16:20].cpu().numpy().tobytes())[0]:
            raise CodecError("splitzip escape count disagrees with the payload size")
        return out, err
    run = _Launcher(dev)
    flat = out.view(-1).view(torch.int16)
    half = n // 2
    if half:
        run(_decode, (_cdiv(half, block_pairs),), data, data[HEADER_BYTES : HEADER_BYTES + half],
            data[sm_at : sm_at + 2 * half].view(torch.int16), flat[: 2 * half].view(torch.int32), err, half, m,
            BP=block_pairs, num_warps=num_warps)
    if n & 1:
        run(_decode_tail, (1,), data, flat, err, HEADER_BYTES + half, sm_at + n - 1, n - 1, m, num_warps=1)
    if m:
        at = sm_at + n
        run(_patch, (_cdiv(m, PATCH_BLOCK),), data[at : at + 4 * m], data[at + 4 * m :], flat, err, n, m,
            BLOCK=PATCH_BLOCK, num_warps=4)
    if target is not None and out is not target:
        target.copy_(out)
        out = target
    return out, err


def raise_if_invalid(error_flags: torch.Tensor) -> None:
    """Raise :class:`CodecError` if a decode's device checks failed (one host synchronisation)."""
    flags = error_flags.cpu().tolist()
    if flags[ERR_ESCAPE_COUNT]:
        raise CodecError("splitzip escape count disagrees with the payload size")
    if flags[ERR_POSITIONS]:
        raise CodecError("splitzip escape positions are out of range or not strictly increasing")


def decode_splitzip_gpu(
    payload: torch.Tensor | bytes | bytearray | memoryview,
    n: int,
    out: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    """Decode a bfloat16 SplitZip payload (device tensor or host bytes) into ``n`` values on the device.

    Returns ``out`` (or a new 1-D bfloat16 tensor). Sizes are checked before
    any kernel runs; escape positions are checked on the device and read back
    once at the end (one host synchronisation), raising :class:`CodecError`.
    Host bytes go to ``device=`` (default: ``out``'s device, else CUDA).
    """
    out, err = decode_splitzip_gpu_async(payload, n, out, **options)
    raise_if_invalid(err)
    return out


# Chunks around these payloads (the chunk format) are made and read one level up: vllm_kvcodec.format.device_chunks.SplitZipGPU.


__all__ = [
    "HIST_MODES", "device_payload_buffer", "can_run_on", "codebook_gpu", "interpreted", "decode_splitzip_gpu", "decode_splitzip_gpu_async",
    "encode_splitzip_gpu", "encode_splitzip_gpu_bytes", "payload_size", "raise_if_invalid",
]
