"""Pick the layout for a KV cache tensor; refuse, with a reason, anything unknown.

The attention backend decides the layout, the tensor decides the geometry:

- ``CPU_ATTN``: ``[num_blocks, kv_heads, block_size, 2*head_size]``; the page
  interior depends on the ISA string of the layer (``layer.isa``): ``amx`` ->
  :class:`CpuAttnAmxLayout`, ``vec`` / ``vec16`` (and every head size that is
  not a multiple of 32) -> the VEC layout. Checked against vLLM's own write op
  before it is returned (``verify``), when that op is importable. An fp8
  cache (``kv_cache_dtype`` ``fp8``/``fp8_e4m3``/``fp8_e5m2``, a ``uint8``
  tensor) gets the same layouts over float8 elements, and its check against
  the op is not optional: where the op cannot write fp8 the layout is refused.
- ``FLASH_ATTN`` / ``FLASHINFER`` / ``TRITON_ATTN`` / ``FLEX_ATTENTION``: the
  packed K‖V view of vLLM >= 0.28 (4-D), or the split K/V tensors of older
  vLLM (5-D: ``(2, B, N, H, D)`` for FlashAttention, ``(B, 2, N, H, D)`` for
  FlashInfer).
- ``CPU_MLA``: the latent cache of multi-head latent attention,
  ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (:mod:`.latent`),
  checked against vLLM's CPU MLA write.
- anything else (the GPU and AMX MLA backends, fp8 caches of GPU backends, nvfp4 and the other
  quantised caches, padded head sizes, other backends and ISAs):
  :class:`UnknownLayoutError`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from vllm_kvcodec.paged.base import (
    CANONICAL_DTYPES,
    FLOAT8_DTYPES,
    Geometry,
    PagedLayout,
    PagedLayoutError,
    UnknownLayoutError,
)
from vllm_kvcodec.paged.cpu_attn import (
    cpu_attn_layout,
    engine_isa,
    kernel_isa,
    verify_with_vllm_op,
    vllm_write_op_available,
)
from vllm_kvcodec.paged.latent import LATENT_BACKENDS, LatentLayout, latent_geometry, verify_with_cpu_mla_write
from vllm_kvcodec.paged.packed import (
    PACKED_BACKENDS,
    FlashInferSplitKVLayout,
    FlashSplitKVLayout,
    PackedKVLayout,
)

_ALIASES = {
    "CPU": "CPU_ATTN",
    "FLASH": "FLASH_ATTN",
    "FLASH_ATTENTION": "FLASH_ATTN",
    "TRITON": "TRITON_ATTN",
    "FLEX": "FLEX_ATTENTION",
}
KNOWN_BACKENDS = ("CPU_ATTN", *PACKED_BACKENDS, *LATENT_BACKENDS)
_UNQUANTISED_CACHE_DTYPES = frozenset({"auto", "bfloat16", "float16", "half", "float32", "float"})
#: vLLM's fp8 ``kv_cache_dtype`` names -> the float8 format their uint8 cache holds ("fp8" is E4M3).
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_CACHE_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}

Verify = bool | Literal["auto"]


def layout_for(
    source: Any,
    kv_cache: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    num_kv_heads: int | None = None,
    head_size: int | None = None,
    block_size: int | None = None,
    isa: str | None = None,
    kv_cache_dtype: str | None = None,
    layer_name: str | None = None,
    verify: Verify = "auto",
) -> PagedLayout:
    """The layout for one layer's ``kv_cache`` (as passed to ``register_kv_caches``).

    ``source`` says which attention backend wrote the cache: its name
    (``"CPU_ATTN"``, ``"FLASH_ATTN"``, ...), an ``AttentionBackend`` class, a
    vLLM ``Attention`` layer, or a ``VllmConfig`` together with ``layer_name``
    (the layer is then looked up in ``compilation_config.static_forward_context``,
    which is populated by the time ``register_kv_caches`` runs). From a layer
    the factory also reads ``isa``, ``head_size``, ``num_kv_heads`` and
    ``kv_cache_dtype``. The keyword arguments, when given, are cross-checked
    against the tensor; ``block_size`` is the *kernel* block size, which is
    the tensor's token axis.

    ``verify``: ``"auto"`` checks CPU_ATTN layouts against vLLM's own write op
    whenever it is importable (for an fp8 cache: always, and refuses the
    layout where the op cannot write fp8), ``True`` requires that check,
    ``False`` skips it (tests of the formulas only).
    """
    backend, info = _resolve_source(source, layer_name)
    isa = isa or info.get("isa")
    kv_cache_dtype = kv_cache_dtype or info.get("kv_cache_dtype")
    dtype = dtype or info.get("dtype")
    head_size = head_size or info.get("head_size")
    num_kv_heads = num_kv_heads or info.get("num_kv_heads")

    if not isinstance(kv_cache, torch.Tensor):
        raise PagedLayoutError(
            f"expected the per-layer KV cache tensor, got {type(kv_cache).__name__}"
            " (a layer without per-layer views, e.g. Mamba state, has no KV to move)"
        )
    if backend.endswith("MLA") or backend in LATENT_BACKENDS:
        return _latent_layout(backend, kv_cache, kv_cache_dtype, dtype, head_size, block_size,
                              info.get("kv_lora_rank"), verify)
    if info.get("head_size_v") not in (None, head_size):
        raise UnknownLayoutError(
            f"{backend}: K and V head sizes differ ({head_size} vs {info['head_size_v']}); "
            "no canonical [2, T, H, D] layout for that"
        )
    elements = _element_dtype(backend, kv_cache, kv_cache_dtype, dtype)
    geometry = _geometry(backend, kv_cache, head_size, num_kv_heads, block_size, elements)
    if elements in FLOAT8_DTYPES:
        return _fp8_layout(backend, kv_cache, geometry, isa, dtype or torch.bfloat16, verify)

    if backend == "CPU_ATTN":
        if kv_cache.dim() != 4:
            raise UnknownLayoutError(f"CPU_ATTN KV cache must be 4-D, got shape {tuple(kv_cache.shape)}")
        if isa is None:
            isa = engine_isa(
                kv_cache.dtype, geometry.block_size, geometry.head_size, _dtype_name(kv_cache_dtype or "auto")
            )
        layout = cpu_attn_layout(isa, geometry)
        if verify is True or (verify == "auto" and kv_cache.device.type == "cpu"):
            if vllm_write_op_available():
                verify_with_vllm_op(layout, isa)
            elif verify is True:
                raise UnknownLayoutError("verify=True but vLLM's cpu_attn_reshape_and_cache op is not importable")
        layout.check_cache(kv_cache)
        return layout

    if backend in PACKED_BACKENDS:
        if kv_cache.dim() == 4:
            layout = PackedKVLayout(geometry)
        elif kv_cache.dim() == 5 and backend == "FLASH_ATTN":
            layout = FlashSplitKVLayout(geometry)
        elif kv_cache.dim() == 5 and backend == "FLASHINFER":
            layout = FlashInferSplitKVLayout(geometry)
        else:
            raise UnknownLayoutError(f"{backend}: no known layout for a KV cache of shape {tuple(kv_cache.shape)}")
        layout.check_cache(kv_cache)
        return layout

    raise UnknownLayoutError(
        f"no page layout for attention backend {backend!r} "
        f"(known: {', '.join(KNOWN_BACKENDS)}); refusing to guess its layout"
    )


def layouts_for(vllm_config: Any, kv_caches: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, PagedLayout]:
    """One layout per layer of ``register_kv_caches``' dict (shared where the geometry is equal).

    Layers that read another layer's KV (cross-layer KV sharing, see
    :func:`shared_kv_layers`) get a layout too; the connector should
    save/load only the target layer.
    """
    out: dict[str, PagedLayout] = {}
    seen: dict[tuple, PagedLayout] = {}
    for name, cache in kv_caches.items():
        layer = _layer(vllm_config, name)
        sig = (
            _backend_name(layer.attn_backend),
            getattr(layer, "isa", None),
            _dtype_name(getattr(layer, "kv_cache_dtype", "auto")),
            tuple(cache.shape[1:]),
            cache.dtype,
            cache.dim(),
        )
        if sig not in seen:
            seen[sig] = layout_for(layer, cache, **kwargs)
        else:
            seen[sig].check_cache(cache)
        out[name] = seen[sig]
    return out


def shared_kv_layers(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> dict[str, str]:
    """Layers that read another layer's KV (vLLM's cross-layer KV sharing) -> that layer.

    Told by vLLM itself (``layer.kv_sharing_target_layer_name``), never by
    pointers: with the hybrid KV cache manager, layers of different KV cache
    groups share one tensor (same storage, offset, shape and strides) and
    differ only by the block ids each group owns, so equal pointers do not
    mean shared KV.
    """
    ctx = vllm_config.compilation_config.static_forward_context
    shared = {}
    for name in kv_caches:
        target = getattr(ctx.get(name), "kv_sharing_target_layer_name", None)
        if target:
            shared[name] = target
    return shared


# ---- helpers ------------------------------------------------------------------------------
def _element_dtype(backend: str, kv_cache: torch.Tensor, kv_cache_dtype: Any, dtype: torch.dtype | None) -> torch.dtype:
    """What the cache's elements are: its own dtype, or for an fp8 cache the float8 format of its uint8 bytes."""
    name = _dtype_name(kv_cache_dtype) if kv_cache_dtype is not None else None
    if name in FP8_CACHE_DTYPES:
        if kv_cache.dtype not in (torch.uint8, FP8_CACHE_DTYPES[name]):
            raise PagedLayoutError(f"{backend}: kv_cache_dtype={name!r} but the cache tensor is {kv_cache.dtype}")
        return FP8_CACHE_DTYPES[name]
    if name is not None and name not in _UNQUANTISED_CACHE_DTYPES:
        raise UnknownLayoutError(
            f"{backend}: kv_cache_dtype={kv_cache_dtype!r} is not supported: vllm-kvcodec moves bfloat16, "
            "float16, float32 and fp8 (fp8, fp8_e4m3, fp8_e5m2) caches; the other quantised caches carry "
            "scales or packing inside the page"
        )
    if kv_cache.dtype not in CANONICAL_DTYPES or kv_cache.dtype in FLOAT8_DTYPES:
        raise UnknownLayoutError(
            f"{backend}: KV cache tensor dtype {kv_cache.dtype} is not bfloat16/float16/float32 "
            "(an fp8 cache is told by its layer's kv_cache_dtype; other quantised caches are not supported)"
        )
    if dtype is not None and dtype != kv_cache.dtype:
        raise PagedLayoutError(f"{backend}: KV cache dtype {kv_cache.dtype} != expected {dtype}")
    return kv_cache.dtype


def _fp8_layout(backend: str, kv_cache: torch.Tensor, geometry: Geometry, isa: str | None,
                model_dtype: torch.dtype, verify: Verify) -> PagedLayout:
    """An fp8 cache's layout: CPU_ATTN only, and only once vLLM's own op wrote the same bytes."""
    if backend != "CPU_ATTN":
        raise UnknownLayoutError(
            f"{backend}: fp8 KV caches of GPU backends are not supported yet (their write op quantises "
            "with round-to-nearest and cannot be checked here); refusing rather than guessing their bytes"
        )
    if kv_cache.dim() != 4:
        raise UnknownLayoutError(f"CPU_ATTN KV cache must be 4-D, got shape {tuple(kv_cache.shape)}")
    if isa is None:
        try:
            isa = engine_isa(model_dtype, geometry.block_size, geometry.head_size, FP8_CACHE_NAMES[geometry.dtype])
        except NotImplementedError as exc:  # vLLM's own refusal, e.g. no AVX-512/AMX
            raise UnknownLayoutError(f"CPU_ATTN: vLLM refuses this fp8 KV cache here: {exc}") from None
    layout = cpu_attn_layout(isa, geometry)
    if verify is not False:
        if not vllm_write_op_available():
            raise UnknownLayoutError("an fp8 CPU_ATTN layout is only used once checked against vLLM's "
                                     "cpu_attn_reshape_and_cache op, which is not importable here")
        verify_with_vllm_op(layout, isa)
    layout.check_cache(kv_cache)
    return layout


def _latent_layout(backend: str, kv_cache: torch.Tensor, kv_cache_dtype: Any, dtype: torch.dtype | None,
                   head_size: int | None, block_size: int | None, kv_lora_rank: int | None,
                   verify: Verify) -> PagedLayout:
    """An MLA cache's layout: CPU_MLA's unquantised latent cache, once vLLM's own write put latents where it reads."""
    if backend not in LATENT_BACKENDS:
        raise UnknownLayoutError(
            f"{backend}: the latent pages of this MLA backend are not checked here (covered: "
            f"{', '.join(LATENT_BACKENDS)}); refusing to guess their layout"
        )
    elements = _element_dtype(backend, kv_cache, kv_cache_dtype, dtype)
    if elements in FLOAT8_DTYPES:
        raise UnknownLayoutError(f"{backend}: fp8 latent caches are not supported (vLLM's CPU MLA backend has none)")
    layout = LatentLayout(latent_geometry(backend, kv_cache, head_size, block_size))
    if verify is True and kv_lora_rank is None:
        raise UnknownLayoutError(f"{backend}: verify=True needs the layer's kv_lora_rank")
    if verify is True or (verify == "auto" and kv_lora_rank is not None and kv_cache.device.type == "cpu"):
        verify_with_cpu_mla_write(layout, int(kv_lora_rank))
    layout.check_cache(kv_cache)
    return layout


def _dtype_name(dtype: Any) -> str:
    return str(dtype).lower().removeprefix("torch.")


def _backend_name(backend: Any) -> str:
    name = backend.get_name() if hasattr(backend, "get_name") else str(backend)
    name = name.upper()
    return _ALIASES.get(name, name)


def _layer(vllm_config: Any, layer_name: str | None) -> Any:
    try:
        ctx = vllm_config.compilation_config.static_forward_context
    except AttributeError:
        raise PagedLayoutError("expected a VllmConfig (with compilation_config.static_forward_context)") from None
    if layer_name is None:
        names = [n for n, layer in ctx.items() if hasattr(layer, "attn_backend")]
        if not names:
            raise PagedLayoutError("the VllmConfig has no attention layers yet (call after the model is built)")
        layer_name = names[0]
    try:
        layer = ctx[layer_name]
    except KeyError:
        raise PagedLayoutError(f"no layer {layer_name!r} in the forward context") from None
    if not hasattr(layer, "attn_backend"):
        raise UnknownLayoutError(f"layer {layer_name!r} ({type(layer).__name__}) is not an attention layer")
    return layer


def _resolve_source(source: Any, layer_name: str | None) -> tuple[str, dict[str, Any]]:
    if isinstance(source, str):
        return _backend_name(source), {}
    if hasattr(source, "compilation_config") and hasattr(source, "model_config"):
        layer = _layer(source, layer_name)
        name, info = _resolve_source(layer, None)
        model_dtype = getattr(source.model_config, "dtype", None)
        info.setdefault("dtype", model_dtype if isinstance(model_dtype, torch.dtype) else None)
        info.setdefault("kv_cache_dtype", getattr(source.cache_config, "cache_dtype", None))
        return name, info
    if hasattr(source, "attn_backend"):  # a vLLM Attention layer
        info = {
            key: getattr(source, key)
            for key in ("isa", "head_size", "head_size_v", "num_kv_heads", "kv_cache_dtype", "kv_lora_rank")
            if getattr(source, key, None) is not None
        }
        return _backend_name(source.attn_backend), info
    if hasattr(source, "get_name"):
        return _backend_name(source), {}
    raise PagedLayoutError(
        f"cannot tell the attention backend from a {type(source).__name__}; pass its name, "
        "an AttentionBackend class, an Attention layer, or a VllmConfig with layer_name"
    )


def _geometry(
    backend: str,
    t: torch.Tensor,
    head_size: int | None,
    num_kv_heads: int | None,
    block_size: int | None,
    elements: torch.dtype,
) -> Geometry:
    if t.dim() == 4:
        _, h, n, c = t.shape
        if c % 2:
            raise UnknownLayoutError(f"{backend}: content axis {c} is odd, not K‖V")
        d = c // 2
    elif t.dim() == 5:
        # legacy split layouts: (2, B, N, H, D) or (B, 2, N, H, D)
        n, h, d = t.shape[2], t.shape[3], t.shape[4]
    else:
        raise UnknownLayoutError(f"{backend}: no known layout for a {t.dim()}-D KV cache {tuple(t.shape)}")
    if head_size is not None and head_size != d:
        raise UnknownLayoutError(
            f"{backend}: the cache holds {d} elements per K (or V) but head_size={head_size} "
            "(padded or quantised content); refusing to guess where K and V live"
        )
    if num_kv_heads is not None and num_kv_heads != h:
        raise PagedLayoutError(f"{backend}: cache has {h} kv heads, expected {num_kv_heads}")
    if block_size is not None and block_size != n:
        raise PagedLayoutError(
            f"{backend}: cache blocks hold {n} tokens, expected {block_size}; with kernel block "
            "splitting the layout's block size is the tensor's (kernel) block size"
        )
    return Geometry(num_kv_heads=int(h), head_size=int(d), block_size=int(n), dtype=elements)


__all__ = ["layout_for", "layouts_for", "shared_kv_layers", "kernel_isa", "KNOWN_BACKENDS"]
