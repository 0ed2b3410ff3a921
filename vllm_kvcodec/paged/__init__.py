"""Paged-memory adapters: canonical ``[2, tokens, kv_heads, head_dim]`` KV in and out of vLLM's KV cache.

The only place in vllm-kvcodec that knows how attention backends lay KV out in
paged memory. Start with :func:`adapter_for` (or :func:`adapters_for` for the
whole ``register_kv_caches`` dict), then ``adapter.gather(cache, slots)`` and
``adapter.scatter(cache, slots, kv)``. See docs/paged-layouts.md.
"""

from vllm_kvcodec.paged.base import (
    CANONICAL_NAMESPACE,
    Geometry,
    LayoutMismatchError,
    PagedKVAdapter,
    PagedLayoutError,
    SlotError,
    UnknownLayoutError,
)
from vllm_kvcodec.paged.cpu_attn import (
    CpuAttnAmxAdapter,
    CpuAttnVec16Adapter,
    CpuAttnVecAdapter,
    cpu_attn_adapter,
    engine_isa,
    kernel_isa,
    verify_with_vllm_op,
)
from vllm_kvcodec.paged.factory import KNOWN_BACKENDS, adapter_for, adapters_for, shared_kv_layers
from vllm_kvcodec.paged.packed import (
    FlashInferSplitKVAdapter,
    FlashSplitKVAdapter,
    PackedKVAdapter,
)
from vllm_kvcodec.paged.slots import slots_for_tokens

__all__ = [
    "CANONICAL_NAMESPACE",
    "KNOWN_BACKENDS",
    "CpuAttnAmxAdapter",
    "CpuAttnVec16Adapter",
    "CpuAttnVecAdapter",
    "FlashInferSplitKVAdapter",
    "FlashSplitKVAdapter",
    "Geometry",
    "LayoutMismatchError",
    "PackedKVAdapter",
    "PagedKVAdapter",
    "PagedLayoutError",
    "SlotError",
    "UnknownLayoutError",
    "adapter_for",
    "adapters_for",
    "cpu_attn_adapter",
    "engine_isa",
    "kernel_isa",
    "shared_kv_layers",
    "slots_for_tokens",
    "verify_with_vllm_op",
]
