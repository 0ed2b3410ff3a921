"""GPU attention layouts: K and V packed per token (vLLM >= 0.28), and the older split layouts.

Packed K‖V (``packed-kv-v1``): FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION
    Since vLLM's KV-cache layout refactor (RFC #42082, PR #44455 "Pack K/V
    into the content dim across attention backends"; in vLLM 0.32 and 0.33) every
    non-MLA layer's cache is a *logical* view ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]`` whose last axis holds K then V of one token
    and head::

        cache[b, h, n, :head_size]  = K of token (b, n), head h
        cache[b, h, n, head_size:]  = V of token (b, n), head h

    The backends read it as ``kv_cache.transpose(1, 2).split(head_size, -1)``
    (``flash_attn.py``, ``triton_attn.py``, ``flex_attention.py``; FlashInfer
    permutes by the layout first). The *physical* order is a stride permutation
    of ``[L, B, H, N, C]`` chosen once per engine (``KVCacheLayout``:
    ``LBNHC`` = legacy "NHD", the default for these backends; ``LBHNC`` =
    "HND"; the block-outer ``BL..`` forms interleave layers inside a block).
    Since this layout indexes the logical view, every stride order works
    unchanged; ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` no longer
    exist. Same logical view as CPU_ATTN, but here the last axis really is
    K‖V per token, while CPU_ATTN reinterprets the page bytes (see cpu_attn.py).
    Not covered (refused by the factory): fp8 caches (uint8 storage, scaled),
    FlashInfer NVFP4 (``[B, 2*H, N, packed]``), Triton's padded head size
    (content axis wider than ``2 * head_size``), MLA (one latent, no V).

Split K/V, vLLM before the refactor (``flash-split-v1``, ``flashinfer-split-v1``)
    ``FlashAttentionBackend.get_kv_cache_shape`` returned
    ``(2, num_blocks, block_size, num_kv_heads, head_size)`` and FlashInfer
    ``(num_blocks, 2, block_size, num_kv_heads, head_size)``, physically
    permuted by ``get_kv_cache_stride_order`` (NHD: identity, HND: heads before
    tokens). Again the layouts index the logical view, so either stride order
    works. Kept for engines pinned to those versions.
"""

from __future__ import annotations

import torch

from vllm_kvcodec.paged.base import PagedLayout, PagedLayoutError

#: Backends of vLLM >= 0.28 whose non-quantised caches are the packed K‖V view.
PACKED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


class PackedKVLayout(PagedLayout):
    """Logical ``[num_blocks, kv_heads, block_size, 2*head_size]``, K‖V per token; any strides."""

    layout_id = "packed-kv-v1"
    backends = PACKED_BACKENDS

    def num_blocks(self, layer_cache: torch.Tensor) -> int:
        return layer_cache.shape[0]

    def _check_shape(self, c: torch.Tensor) -> None:
        self._check_logical_bhn2d(c)

    def _gather(self, c: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        blk, off = self._split(slots)
        tokens = c[blk, :, off]  # [T, H, 2D]
        d = self.geometry.head_size
        out[0] = tokens[..., :d]
        out[1] = tokens[..., d:]

    def _scatter(self, c: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        blk, off = self._split(slots)
        c[blk, :, off] = torch.cat((kv[0], kv[1]), dim=-1)


class SplitKVLayout(PagedLayout):
    """Pre-refactor 5-D caches with a separate K/V axis at ``kv_dim`` (0: FlashAttention, 1: FlashInfer)."""

    kv_dim: int = 0

    @property
    def block_axis(self) -> int:  # type: ignore[override]
        return 1 - self.kv_dim

    def num_blocks(self, layer_cache: torch.Tensor) -> int:
        return layer_cache.shape[1 - self.kv_dim]

    def _check_shape(self, c: torch.Tensor) -> None:
        g = self.geometry
        inner = (g.block_size, g.num_kv_heads, g.head_size)
        ok = c.dim() == 5 and c.shape[self.kv_dim] == 2 and tuple(c.shape[2:]) == inner
        if self.kv_dim == 0:
            want = f"[2, num_blocks, {g.block_size}, {g.num_kv_heads}, {g.head_size}]"
        else:
            want = f"[num_blocks, 2, {g.block_size}, {g.num_kv_heads}, {g.head_size}]"
        if not ok:
            raise PagedLayoutError(f"{self.layout_id}: expected a {want} KV cache, got {tuple(c.shape)}")

    def _gather(self, c: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        blk, off = self._split(slots)
        if self.kv_dim == 0:
            out.copy_(c[:, blk, off])  # adjacent advanced indices -> [2, T, H, D]
        else:
            out.copy_(c[blk, :, off].transpose(0, 1))  # [T, 2, H, D] -> [2, T, H, D]

    def _scatter(self, c: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        blk, off = self._split(slots)
        if self.kv_dim == 0:
            c[:, blk, off] = kv
        else:
            c[blk, :, off] = kv.transpose(0, 1)


class FlashSplitKVLayout(SplitKVLayout):
    """FlashAttention before the refactor: ``(2, num_blocks, block_size, kv_heads, head_size)``."""

    layout_id = "flash-split-v1"
    backends = ("FLASH_ATTN",)
    kv_dim = 0


class FlashInferSplitKVLayout(SplitKVLayout):
    """FlashInfer before the refactor: ``(num_blocks, 2, block_size, kv_heads, head_size)``."""

    layout_id = "flashinfer-split-v1"
    backends = ("FLASHINFER",)
    kv_dim = 1
