"""Dequantise a lossy ``quantized`` object straight into vLLM's packed K‖V pages: one launch per layer group.

LOSSY: NOT BIT-EXACT against the KV that was saved. What is exact is the
dequantisation: every value this kernel writes equals, bit for bit, the
reference (``codecs.quantized.dequantize`` then rounding to the source dtype),
which the CPU decoder writes too, so a lossy object loads to the same cache
bytes on a GPU as on a host.

The reference is ``y = float32(q) * step`` rounded to float32, then ``+ min``
rounded to float32, then rounded to the source dtype to nearest even. Two
things would change bits if left to the compiler:

* **Fused multiply-add.** LLVM and ``ptxas`` contract ``q * step + min`` into
  one ``fma.rn.f32`` (one rounding, not two): on sm_90 the plain expression
  compiles to ``FFMA`` (seen in the SASS; tests/gpu/test_gpu_dequant.py
  compiles this kernel for sm_90 here and holds it to ``FMUL`` + ``FADD``). So
  on CUDA the product and the sum are inline PTX ``mul.rn.f32`` and
  ``add.rn.f32``: an explicit rounding modifier is never contracted (PTX ISA,
  "mul"/"add": "mul/add sequences with no rounding modifiers may be optimized
  to use fused-multiply-add"; with one they are not), and inline assembly is
  opaque to LLVM. Triton's interpreter has no inline assembly; it runs the
  same two operations as numpy float32 ufuncs, each rounded on its own, which
  is the reference's own arithmetic (``EXACT_ASM`` picks, at compile time).
* **float32 to bfloat16.** Triton's interpreter rounds a float32 to bfloat16
  half-up (and its carry does not reach the exponent), so the kernel rounds
  the bits itself, to nearest even, the same integer code on CUDA and in the
  interpreter: ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` (no NaN can
  arise: the scales are checked finite, a step positive). float16 goes
  through the ordinary cast (``cvt.rn.f16.f32`` on CUDA, numpy's round to
  nearest even in the interpreter); float32 is the sum itself.

The kept full-precision values (the object's first ``full_layers`` layers,
the other layers' first ``sink_tokens`` tokens) are copied as they are, as
integers, in the same launch. Program grid: (token tiles of the span, kv
heads, layers of the group), as :mod:`.scatter_triton`'s ``_move``, through
the same pointer table and row addresses (:class:`~.scatter_triton.PackedPages`).

Inputs are trusted here: the host checked every size, scale and integer range
(``QuantizedCodec.unpack``) before anything reached the device, and the slots
against the cache (:func:`~.scatter_triton.check_slots`); this module checks
only that the tensors it is handed fit the pages and each other.

Every device pointer the kernel gets is 16-byte aligned by its callers (the
staging layout, the pointer table's base), and the integer arguments are not
specialised on, so one compiled kernel serves every object of a placement
(``warm`` compiles it before the fetch threads would).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from vllm_kvcodec.gpu.launch import cdiv
from vllm_kvcodec.gpu.scatter_triton import PackedPages, page_rows
from vllm_kvcodec.paged.base import PagedLayoutError, SlotError

#: Output kinds (compile-time): how a float32 value becomes the cache's bits.
_OUT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """A quantized object's parts on the device, as ``QuantizedCodec.unpack`` reads them (every one contiguous).

    ``keys``/``values``: uint8 ``[Lq, Tq, heads, dim]`` (``Lq = layers - full_layers``, ``Tq = tokens -
    sink_tokens``); ``k_min``/``k_step``: float32 ``[Lq, heads, dim]``; ``v_min``/``v_step``: float32 ``[Lq, Tq,
    heads]``; ``kept``: the kept values' bits (int16, or int32 for float32), flat: ``[full_layers, 2, tokens, heads,
    dim]`` then ``[Lq, 2, sink_tokens, heads, dim]``; ``dtype``: the values' (the cache's) dtype.
    """

    keys: torch.Tensor
    values: torch.Tensor
    k_min: torch.Tensor
    k_step: torch.Tensor
    v_min: torch.Tensor
    v_step: torch.Tensor
    kept: torch.Tensor
    layers: int
    tokens: int
    full_layers: int
    sink_tokens: int
    dtype: torch.dtype

    @property
    def heads(self) -> int:
        return int(self.keys.shape[2])

    @property
    def head_size(self) -> int:
        return int(self.keys.shape[3])

    def check(self) -> None:
        """Raise :class:`PagedLayoutError` unless the parts fit each other (shapes, dtypes, one device, contiguous)."""
        lq, tq = self.layers - self.full_layers, self.tokens - self.sink_tokens
        heads, dim = self.heads, self.head_size
        if self.dtype not in _OUT or lq < 0 or tq < 0:
            raise PagedLayoutError(f"no dequantisation of {self.layers} layers x {self.tokens} tokens "
                                   f"({self.full_layers} full, {self.sink_tokens} sink) to {self.dtype}")
        kept = (self.full_layers * 2 * self.tokens + lq * 2 * self.sink_tokens) * heads * dim
        want = {"keys": ((lq, tq, heads, dim), torch.uint8), "values": ((lq, tq, heads, dim), torch.uint8),
                "k_min": ((lq, heads, dim), torch.float32), "k_step": ((lq, heads, dim), torch.float32),
                "v_min": ((lq, tq, heads), torch.float32), "v_step": ((lq, tq, heads), torch.float32),
                "kept": ((kept,), _BITS[self.dtype])}
        for name, (shape, dtype) in want.items():
            t: torch.Tensor = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != self.keys.device or not t.is_contiguous():
                raise PagedLayoutError(f"quantized {name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected a "
                                       f"contiguous {shape} {dtype} on {self.keys.device}")


@triton.jit
def _mul_add(q, step, minimum, EXACT_ASM: tl.constexpr):
    """``q * step`` rounded to float32, then ``+ minimum`` rounded: two roundings, never one fused multiply-add."""
    if EXACT_ASM:
        product = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [q, step], dtype=tl.float32,
                                            is_pure=True, pack=1)
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [product, minimum],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        product = q * step
        return product + minimum


@triton.jit
def _to_bits(y, OUT: tl.constexpr):
    """float32 values as the cache's bits: bfloat16 (to nearest even, in integers), float16, or float32 as is."""
    if OUT == 0:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.int16, bitcast=True)
    elif OUT == 1:
        return y.to(tl.float16).to(tl.int16, bitcast=True)
    else:
        return y.to(tl.int32, bitcast=True)


@triton.jit(do_not_specialize=["first_layer", "count", "first_token", "tokens", "full", "sink", "heads",
                               "block_size", "c_sb", "c_sh", "c_sn"])
def _dequantize_scatter(keys_ptr, values_ptr, kmin_ptr, kstep_ptr, vmin_ptr, vstep_ptr, kept_ptr,
                        table_ptr, slots_ptr, first_layer, count, first_token, tokens, full, sink, heads,
                        block_size, c_sb, c_sh, c_sn,
                        HEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr,
                        PTR_ALIGN: tl.constexpr, ROW_ALIGN: tl.constexpr, OUT: tl.constexpr,
                        EXACT_ASM: tl.constexpr):
    """``count`` tokens of one head of one layer: span token ``t`` is object token ``first_token + t`` and goes to
    ``slots[t]``. A kept value (a full layer, or a sink token) is copied; any other is dequantised."""
    t, d, h, layer, live, page = page_rows(table_ptr + first_layer, slots_ptr, count, block_size, c_sb, c_sh, c_sn,
                                           kept_ptr.dtype.element_ty, BT, BD, VEC, PTR_ALIGN)  # as the scatter's
    dmask = d < HEAD
    mask = live[:, None] & dmask[None, :]
    # what the object holds for them (int64 offsets: an object may hold up to 2**31 elements)
    tokens, full, sink = tokens.to(tl.int64), full.to(tl.int64), sink.to(tl.int64)
    tt = first_token + t.to(tl.int64)  # the object's token
    tq_all = tokens - sink
    is_full = tt * 0 + layer < full  # per token, not a scalar: the interpreter widens a scalar bool's | to int64
    lq = tl.maximum(layer - full, 0)
    tq = tl.maximum(tt - sink, 0)
    kept_tok = is_full | (tt < sink)  # [BT]
    plane = heads * HEAD  # one token's values of one layer's K (or V)
    # rows start at multiples of HEAD elements, which tl.where hides from the compiler: ROW_ALIGN (the largest power
    # of two dividing HEAD, at most 16) says so, and the kept values load as whole vectors
    kept_row = tl.multiple_of(tl.where(is_full, (layer * 2 * tokens + tt) * plane,
                                       full * 2 * tokens * plane + (lq * 2 * sink + tt) * plane) + h * HEAD, ROW_ALIGN)
    kept_kv = tl.multiple_of(tl.where(is_full, tokens, sink) * plane, ROW_ALIGN)  # from a kept K row to its V row
    kmask = mask & kept_tok[:, None]
    kept_k = tl.load(kept_ptr + kept_row[:, None] + d[None, :], mask=kmask, other=0)
    kept_v = tl.load(kept_ptr + (kept_row + kept_kv)[:, None] + d[None, :], mask=kmask, other=0)
    qmask = mask & (~kept_tok)[:, None]
    q_row = ((lq * tq_all + tq) * heads + h) * HEAD
    q_k = tl.load(keys_ptr + q_row[:, None] + d[None, :], mask=qmask, other=0).to(tl.float32)
    q_v = tl.load(values_ptr + q_row[:, None] + d[None, :], mask=qmask, other=0).to(tl.float32)
    ch = (lq * heads + h) * HEAD + d  # keys: per channel
    quantized_layer = dmask & (d * 0 + layer >= full)
    k_min = tl.load(kmin_ptr + ch, mask=quantized_layer, other=0.0)
    k_step = tl.load(kstep_ptr + ch, mask=quantized_layer, other=0.0)
    tok = (lq * tq_all + tq) * heads + h  # values: per token
    v_min = tl.load(vmin_ptr + tok, mask=live & ~kept_tok, other=0.0)
    v_step = tl.load(vstep_ptr + tok, mask=live & ~kept_tok, other=0.0)
    y_k = _mul_add(q_k, tl.broadcast_to(k_step[None, :], (BT, BD)), tl.broadcast_to(k_min[None, :], (BT, BD)),
                   EXACT_ASM)
    y_v = _mul_add(q_v, tl.broadcast_to(v_step[:, None], (BT, BD)), tl.broadcast_to(v_min[:, None], (BT, BD)),
                   EXACT_ASM)
    keep = kept_tok[:, None]
    tl.store(page, tl.where(keep, kept_k, _to_bits(y_k, OUT)), mask=mask)
    tl.store(page + HEAD, tl.where(keep, kept_v, _to_bits(y_v, OUT)), mask=mask)


def dequantize_into_pages(pages: PackedPages, first_layer: int, q: QuantizedKV, first_token: int,
                          slots: torch.Tensor) -> None:
    """Write tokens ``[first_token, first_token + len(slots))`` of ``q``, every layer of it, dequantised, into
    ``slots`` of layers ``first_layer...`` of ``pages``: one launch, on the current stream.

    ``slots``: a device int64/int32 tensor, unique and in range (:func:`~.scatter_triton.check_slots`), 16-byte
    aligned as every part of ``q`` (see the module docstring).
    """
    q.check()
    if (q.heads, q.head_size) != (pages.num_heads, pages.head_size) or q.dtype != pages.dtype:
        raise PagedLayoutError(f"quantized KV of {q.heads} heads x {q.head_size} {q.dtype} into caches of "
                               f"{pages.num_heads} x {pages.head_size} {pages.dtype}")
    if q.keys.device != pages.device:
        raise PagedLayoutError(f"quantized KV on {q.keys.device}, the caches on {pages.device}")
    if not 0 <= first_layer <= first_layer + q.layers <= len(pages.caches):
        raise PagedLayoutError(f"layers [{first_layer}, {first_layer + q.layers}) outside the {len(pages.caches)} cached")
    count = slots.numel()
    if (slots.dim() != 1 or slots.device != pages.device or slots.dtype not in (torch.int64, torch.int32)
            or not 0 <= first_token <= first_token + count <= q.tokens):
        raise SlotError(f"slots must be a 1-D int64/int32 tensor on {pages.device} of at most {q.tokens - first_token} "
                        f"tokens from token {first_token}")
    if not count or not q.layers:
        return
    grid = (cdiv(count, pages.block_tokens), q.heads, q.layers)
    pages.launch(_dequantize_scatter, grid, q.keys, q.values, q.k_min, q.k_step, q.v_min, q.v_step, q.kept,
                 pages.table, slots, first_layer, count, first_token, q.tokens, q.full_layers, q.sink_tokens,
                 q.heads, pages.block_size, *pages.strides,
                 HEAD=pages.head_size, BT=pages.block_tokens, BD=pages.block_d, VEC=pages.vec,
                 PTR_ALIGN=pages.ptr_align, ROW_ALIGN=_row_align(pages.head_size), OUT=_OUT[q.dtype],
                 EXACT_ASM=not pages.launch.interpret,
                 num_warps=pages.num_warps)


def _row_align(head_size: int) -> int:
    """The largest power of two (at most 16) dividing ``head_size``: every row of the parts starts at a multiple."""
    return min(16, head_size & -head_size)


__all__ = ["QuantizedKV", "dequantize_into_pages"]
