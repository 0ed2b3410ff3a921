"""Page layouts: canonical ``[planes, tokens, kv_heads, head_dim]`` KV in and out of vLLM's KV cache.

The only place in vllm-kvcodec that knows how attention backends lay KV out in
paged memory. Start with :func:`layout_for` (or :func:`layouts_for` for the
whole ``register_kv_caches`` dict), then ``layout.gather(cache, slots)`` and
``layout.scatter(cache, slots, kv)``. See docs/paged-layouts.md.
"""

from vllm_kvcodec.paged.base import (
    CANONICAL_NAMESPACE,
    Geometry,
    LayoutMismatchError,
    PagedLayout,
    PagedLayoutError,
    SlotError,
    UnknownLayoutError,
)
from vllm_kvcodec.paged.cpu_attn import (
    CpuAttnAmxLayout,
    CpuAttnVec16Layout,
    CpuAttnVecLayout,
    cpu_attn_layout,
    engine_isa,
    kernel_isa,
    verify_with_vllm_op,
)
from vllm_kvcodec.paged.factory import KNOWN_BACKENDS, layout_for, layouts_for, shared_kv_layers
from vllm_kvcodec.paged.latent import LatentLayout
from vllm_kvcodec.paged.packed import (
    FlashInferSplitKVLayout,
    FlashSplitKVLayout,
    PackedKVLayout,
)
from vllm_kvcodec.paged.slots import slots_for_tokens

__all__ = [
    "CANONICAL_NAMESPACE",
    "KNOWN_BACKENDS",
    "CpuAttnAmxLayout",
    "CpuAttnVec16Layout",
    "CpuAttnVecLayout",
    "FlashInferSplitKVLayout",
    "FlashSplitKVLayout",
    "Geometry",
    "LatentLayout",
    "LayoutMismatchError",
    "PackedKVLayout",
    "PagedLayout",
    "PagedLayoutError",
    "SlotError",
    "UnknownLayoutError",
    "layout_for",
    "layouts_for",
    "cpu_attn_layout",
    "engine_isa",
    "kernel_isa",
    "shared_kv_layers",
    "slots_for_tokens",
    "verify_with_vllm_op",
]
