"""Scatter and gather canonical KV into vLLM's packed K‖V paged layout with Triton, all layers in one launch.

The layout is :class:`vllm_kvcodec.paged.PackedKVLayout`'s (``packed-kv-v1``:
FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION in vLLM 0.32/0.33): each
layer's cache is a *logical* ``[num_blocks, kv_heads, block_size, 2*head_size]``
view with any strides (the content axis contiguous, as in every vLLM
layout), and for ``slot = block * block_size + offset``::

    cache[block, h, offset, :head_size] = K[token, h]
    cache[block, h, offset, head_size:] = V[token, h]

The layout does this with torch indexing, one layer per call (index
tensors, a ``torch.cat`` and an indexed copy per layer). Here one launch
moves a whole layer group: the layers' caches are addressed through a device
table of their base pointers (they share shape, strides and dtype, as all
layers of one vLLM KV cache group do), so a chunk of a 30-layer group is one
kernel, not 30 x 4 torch ops. Values move as 16/32-bit integers (bit-exact,
NaN payloads included).

One kernel moves both ways (``TO_PAGES``, a compile-time constant: scatter
or gather), so the two directions share every address computation. Program
grid: (token tiles, kv heads, layers). Each program copies ``BT`` tokens x
``head_size`` of K and of V of one head of one layer. Offsets are
int64 (a block-outer layout's block stride spans all layers, so
``block * stride`` can pass 2**31 elements). The cache pointers come from a
table, so Triton cannot see their alignment: the host computes it (``PTR_ALIGN``
bytes for the bases, ``VEC`` elements for every row start) and the kernels
pass it on with ``tl.multiple_of``, which lets the compiler use 16-byte
loads and stores.

Slots are not range-checked on the device: callers check them on the host
(:func:`check_slots`), where the scheduler's slot lists live, so the hot path
has no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from vllm_kvcodec.gpu.launch import Launcher, cdiv
from vllm_kvcodec.paged.base import PagedLayoutError, SlotError

BLOCK_TOKENS = 32  # tokens per program
NUM_WARPS = 4
_INT_VIEW = {2: torch.int16, 4: torch.int32}


@triton.jit
def page_rows(table_ptr, slots_ptr, tokens, block_size, c_sb, c_sh, c_sn, ELEMENT: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr, VEC: tl.constexpr, PTR_ALIGN: tl.constexpr):
    """This program's tile: tokens ``t`` (``BT`` of ``tokens``), lanes ``d``, head ``h``, layer ``layer`` (of the
    pointer table), which tokens are live, and ``[BT, BD]`` pointers to the K half of their page rows (V is ``HEAD``
    further): every kernel here addresses the pages so."""
    h = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    live = t < tokens
    s = tl.load(slots_ptr + t, mask=live, other=0).to(tl.int64)
    blk = s // block_size
    off = s - blk * block_size
    cache = tl.load(table_ptr + layer).to(tl.pointer_type(ELEMENT))
    row = tl.multiple_of(blk * c_sb + h * c_sh + off * c_sn, VEC)  # host-checked: rows start VEC-aligned
    return t, d, h, layer, live, tl.multiple_of(cache, PTR_ALIGN) + row[:, None] + d[None, :]


@triton.jit
def _move(kv_ptr, table_ptr, slots_ptr, tokens, block_size,
          kv_sl, kv_skv, kv_st, kv_sh,
          c_sb, c_sh, c_sn,
          HEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr,
          PTR_ALIGN: tl.constexpr, TO_PAGES: tl.constexpr):
    """Scatter (``TO_PAGES``: the chunk ``kv`` into the pages) or gather (the pages into ``kv``): the same addresses,
    read on one side and written on the other, so the two directions can never disagree on where a slot lies."""
    t, d, h, layer, live, page = page_rows(table_ptr, slots_ptr, tokens, block_size, c_sb, c_sh, c_sn,
                                           kv_ptr.dtype.element_ty, BT, BD, VEC, PTR_ALIGN)
    mask = live[:, None] & (d < HEAD)[None, :]
    chunk = kv_ptr + layer * kv_sl + t[:, None].to(tl.int64) * kv_st + h * kv_sh + d[None, :]
    if TO_PAGES:
        tl.store(page, tl.load(chunk, mask=mask), mask=mask)
        tl.store(page + HEAD, tl.load(chunk + kv_skv, mask=mask), mask=mask)
    else:
        tl.store(chunk, tl.load(page, mask=mask), mask=mask)
        tl.store(chunk + kv_skv, tl.load(page + HEAD, mask=mask), mask=mask)


def _pow2_dividing(values: list[int], floor: int) -> int:
    """The largest power of two dividing every value (at least ``floor``)."""
    g = 0
    for v in values:
        g |= int(v)
    return max(floor, g & -g) if g else floor


def check_slots(slots: Sequence[int], num_slots: int) -> None:
    """Raise :class:`SlotError` unless every slot is in ``[0, num_slots)`` (host-side, no device sync)."""
    if len(slots) and (min(slots) < 0 or max(slots) >= num_slots):
        raise SlotError(
            f"slot mapping spans [{min(slots)}, {max(slots)}] but the cache holds slots [0, {num_slots}); "
            "drop padding slots (-1) before gather/scatter"
        )


class PackedPages:
    """The packed K‖V caches of a list of layers, addressed by one device pointer table.

    Built once per worker from the tensors of ``register_kv_caches`` (in layer
    order). All layers must share shape, strides, dtype and device; that is
    checked here, so the kernels can use one set of strides. ``scatter`` and
    ``gather`` take a first layer and move ``kv.shape[0]`` consecutive layers.
    """

    def __init__(self, caches: Sequence[torch.Tensor], head_size: int, *,
                 block_tokens: int = BLOCK_TOKENS, num_warps: int = NUM_WARPS) -> None:
        if not caches:
            raise PagedLayoutError("PackedPages needs at least one layer cache")
        first = caches[0]
        if first.dim() != 4 or first.shape[3] != 2 * head_size:
            raise PagedLayoutError(
                f"expected packed [num_blocks, kv_heads, block_size, {2 * head_size}] caches, got {tuple(first.shape)}"
            )
        if first.element_size() not in _INT_VIEW:
            raise PagedLayoutError(f"cache dtype {first.dtype} is not a 16- or 32-bit type")
        for i, c in enumerate(caches):
            if (c.shape, c.stride(), c.dtype, c.device) != (first.shape, first.stride(), first.dtype, first.device):
                raise PagedLayoutError(
                    f"layer {i}'s cache {tuple(c.shape)}/{c.stride()} {c.dtype} {c.device} differs from layer 0's "
                    f"{tuple(first.shape)}/{first.stride()} {first.dtype} {first.device}: one pointer table needs equal layouts"
                )
        self.caches = list(caches)
        self.device, self.dtype, self.head_size = first.device, first.dtype, head_size
        self.num_blocks, self.num_heads, self.block_size = (int(x) for x in first.shape[:3])
        if first.stride(3) != 1:
            raise PagedLayoutError(f"the content axis of the caches must be contiguous, strides are {first.stride()}")
        self.strides = tuple(int(s) for s in first.stride()[:3])
        self.launch = Launcher(self.device)
        ptrs = [c.data_ptr() for c in caches]
        self.table = torch.tensor(ptrs, dtype=torch.int64).to(self.device)
        self.ptr_align = _pow2_dividing([*ptrs, 16], first.element_size())
        self.vec = _pow2_dividing([*self.strides, head_size, 16 // first.element_size()], 1)
        self.block_tokens, self.num_warps = block_tokens, num_warps
        self.block_d = triton.next_power_of_2(head_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def scatter(self, first_layer: int, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``kv`` ``[layers, 2, tokens, heads, head_size]`` into ``slots`` of layers ``first_layer...``.

        ``kv`` may be a token slice of a bigger chunk (any strides, innermost
        contiguous); ``slots`` is a device int64/int32 tensor of ``tokens``
        slots, unique and in range (see :func:`check_slots`). Runs on the
        current stream.
        """
        layers = self._check(first_layer, kv, slots, "kv")
        if layers and kv.shape[2]:
            self._run(first_layer, kv, slots, to_pages=True)

    def gather(self, first_layer: int, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Read ``slots`` of layers ``first_layer...`` into ``out`` ``[layers, 2, tokens, heads, head_size]``."""
        layers = self._check(first_layer, out, slots, "out")
        if layers and out.shape[2]:
            self._run(first_layer, out, slots, to_pages=False)
        return out

    def _run(self, first_layer: int, kv: torch.Tensor, slots: torch.Tensor, *, to_pages: bool) -> None:
        view = _INT_VIEW[kv.element_size()]
        layers, _, tokens, heads, _ = kv.shape
        grid = (cdiv(tokens, self.block_tokens), heads, layers)
        self.launch(_move, grid, kv.view(view), self.table[first_layer:], slots, tokens, self.block_size,
                     *kv.stride()[:4], *self.strides,
                     HEAD=self.head_size, BT=self.block_tokens, BD=self.block_d, VEC=self.vec,
                     PTR_ALIGN=self.ptr_align, TO_PAGES=to_pages, num_warps=self.num_warps)

    def _check(self, first_layer: int, kv: torch.Tensor, slots: torch.Tensor, name: str) -> int:
        want = (self.num_heads, self.head_size)
        if kv.dim() != 5 or kv.shape[1] != 2 or tuple(kv.shape[3:]) != want:
            raise PagedLayoutError(f"{name} must be [layers, 2, tokens, {want[0]}, {want[1]}], got {tuple(kv.shape)}")
        if kv.dtype != self.dtype or kv.device != self.device:
            raise PagedLayoutError(f"{name} is {kv.dtype} on {kv.device}, the caches {self.dtype} on {self.device}")
        if kv.stride(4) != 1:
            raise PagedLayoutError(f"{name}'s head_size axis must be contiguous")
        layers = kv.shape[0]
        if not 0 <= first_layer <= first_layer + layers <= len(self.caches):
            raise PagedLayoutError(f"layers [{first_layer}, {first_layer + layers}) outside the {len(self.caches)} cached")
        if (slots.dim() != 1 or slots.numel() != kv.shape[2] or slots.device != self.device
                or slots.dtype not in (torch.int64, torch.int32)):
            raise SlotError(f"slots must be a 1-D int64/int32 tensor of {kv.shape[2]} slots on {self.device}")
        return layers


def packed_pages_for(caches: Sequence[torch.Tensor], layouts: Sequence[Any]) -> "PackedPages | None":
    """One pointer table over all layers when they are packed K‖V with one layout; else None (layouts scatter)."""
    from vllm_kvcodec.paged import PackedKVLayout

    if not all(type(a) is PackedKVLayout for a in layouts):
        return None
    first = caches[0]
    if first.stride(3) != 1 or any((c.shape, c.stride(), c.dtype) != (first.shape, first.stride(), first.dtype) for c in caches):
        return None
    return PackedPages(caches, layouts[0].head_size)


__all__ = ["packed_pages_for", "PackedPages", "check_slots"]
