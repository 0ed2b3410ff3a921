"""The page layout of a multi-head latent attention (MLA) cache: one latent vector per token.

DeepSeek-V2/V3/R1 and Kimi K2 cache, per layer and token, one vector of
``kv_lora_rank + qk_rope_head_dim`` elements (512 + 64 = 576 for DeepSeek):
the compressed KV latent followed by the rotary part of the key. There are no
K and V per head, so the canonical KV of a latent layer is
``[1, tokens, 1, head_size]``: one plane, one head (``Geometry.planes == 1``).

vLLM's MLA backends allocate ``[num_blocks, block_size, head_size]``
(``MLACommonBackend.get_kv_cache_shape``), token-major inside a block; a
connector is handed the standardized per-layer view ``[num_blocks, 1,
block_size, head_size]`` (one "head"), and this layout takes either. And
the CPU backend (``CPU_MLA``) writes a token's latent to row ``slot`` of the
cache viewed as ``[num_blocks * block_size, head_size]``. That is the only
backend this layout is claimed for: it is checked against vLLM's own write
(``CPUMLAImpl.do_kv_cache_update``) before it is used. The GPU MLA backends
(FlashMLA, CUTLASS MLA, Triton MLA, FlashInfer MLA) and the AMX one pad,
quantise or reorder their pages in ways not checked here, and are refused.
"""

from __future__ import annotations

import torch

from vllm_kvcodec.paged.base import Geometry, LayoutMismatchError, PagedLayout, PagedLayoutError

#: Attention backends whose cache this layout reads, checked against their write op.
LATENT_BACKENDS = ("CPU_MLA",)


class LatentLayout(PagedLayout):
    layout_id = "mla-latent-v1"
    backends = LATENT_BACKENDS

    def __init__(self, geometry: Geometry) -> None:
        if geometry.planes != 1 or geometry.num_kv_heads != 1:
            raise PagedLayoutError(f"a latent cache has one plane and one head, got {geometry}")
        super().__init__(geometry)

    def num_blocks(self, layer_cache: torch.Tensor) -> int:
        return int(layer_cache.shape[0])

    def _check_shape(self, layer_cache: torch.Tensor) -> None:
        g = self.geometry
        if tuple(layer_cache.shape[1:]) not in ((g.block_size, g.head_size), (1, g.block_size, g.head_size)):
            raise PagedLayoutError(
                f"{self.layout_id}: expected a [num_blocks, {g.block_size}, {g.head_size}] latent cache (or its "
                f"[num_blocks, 1, {g.block_size}, {g.head_size}] view), got {tuple(layer_cache.shape)}"
            )

    def _gather(self, layer_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        block, offset = self._split(slots)
        out[0, :, 0] = _rows(layer_cache)[block, offset]

    def _scatter(self, layer_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        block, offset = self._split(slots)
        _rows(layer_cache).index_put_((block, offset), kv[0, :, 0])


def _rows(layer_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, head_size]``, a view of either shape vLLM hands out."""
    return layer_cache[:, 0] if layer_cache.dim() == 4 else layer_cache


def latent_geometry(backend: str, kv_cache: torch.Tensor, head_size: int | None, block_size: int | None) -> Geometry:
    """The geometry of a ``[num_blocks, (1,) block_size, head_size]`` latent cache, cross-checked against the layer."""
    if not (kv_cache.dim() == 3 or (kv_cache.dim() == 4 and kv_cache.shape[1] == 1)):
        raise PagedLayoutError(f"{backend}: a latent cache is [num_blocks, (1,) block_size, head_size], "
                               f"got {tuple(kv_cache.shape)}")
    n, d = kv_cache.shape[-2:]
    if head_size is not None and head_size != d:
        raise PagedLayoutError(f"{backend}: the cache holds {d} elements per token but the layer's head_size "
                               f"is {head_size}")
    if block_size is not None and block_size != n:
        raise PagedLayoutError(f"{backend}: cache blocks hold {n} tokens, expected {block_size}")
    return Geometry(num_kv_heads=1, head_size=int(d), block_size=int(n), dtype=kv_cache.dtype, planes=1)


def verify_with_cpu_mla_write(layout: LatentLayout, kv_lora_rank: int) -> None:
    """Write known latents with vLLM's own CPU MLA cache update, and read them back through ``layout``.

    Raises :class:`LayoutMismatchError` when a single element differs, and
    :class:`PagedLayoutError` when vLLM's CPU MLA backend is not importable.
    """
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    except ImportError as exc:
        raise PagedLayoutError(f"vLLM's CPU MLA backend is not importable to check the latent layout: {exc}") from None
    g = layout.geometry
    if not 0 < kv_lora_rank < g.head_size:
        raise PagedLayoutError(f"kv_lora_rank {kv_lora_rank} does not split a {g.head_size}-wide latent")
    gen = torch.Generator().manual_seed(7)
    blocks = 3
    cache = torch.zeros((blocks, g.block_size, g.head_size), dtype=g.dtype)
    slots = torch.randperm(blocks * g.block_size, generator=gen)[: g.block_size + 3]  # odd count, any order
    latent = torch.randn((slots.numel(), g.head_size), generator=gen).to(g.dtype)
    CPUMLAImpl.do_kv_cache_update(None, latent[:, :kv_lora_rank], latent[:, None, kv_lora_rank:], cache, slots,
                                  "auto", None)
    got = layout.gather(cache, slots)[0, :, 0]
    if not torch.equal(got.view(torch.uint8), latent.view(torch.uint8)):
        raise LayoutMismatchError(f"{layout.layout_id}: vLLM's CPU MLA write put latents where the layout "
                                  "does not read them")
