"""The namespace an engine keys its chunks in, made from vLLM's configuration (see keys/chain.py for what it means).

Both halves make it alike, in the scheduler process and in every worker,
whatever pipeline stage the worker runs: layers are counted over the whole
model and the stages named. An fp8 cache's scales complete it later, at the
workers' handshake (connector/cache_identity.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_kvcodec.connector.cache_groups import FULL, CacheGroups, layer_index
from vllm_kvcodec.connector.cache_identity import cache_dtype_name, compute_dtype_name, is_fp8
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.keys import key_hash
from vllm_kvcodec.keys.chain import Namespace
from vllm_kvcodec.keys.identity import compute_identity, config_inputs, model_identity
from vllm_kvcodec.keys.token_digests import UNIT, digest_unit

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def build_namespace(vllm_config: "VllmConfig", config: ConnectorConfig, cache_groups: CacheGroups | None = None,
                    kv_cache_config: "KVCacheConfig | None" = None) -> Namespace:
    """Everything that must match for two engines to share chunks (see keys/chain.py).

    The same in the scheduler and in every worker, whatever pipeline stage it
    runs: layers are counted over the whole model and the stages named.
    """
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    dtype = cache_dtype_name(vllm_config.cache_config.cache_dtype, model.dtype)
    stages = pipeline_stages(model, parallel, dtype, cache_groups)
    num_layers = sum(stages)
    attention = (_attention(cache_groups, kv_cache_config) if len(stages) == 1
                 else _uniform_attention(cache_groups, num_layers))
    return Namespace(
        model_id=config.model_id or model_identity(model.model, model.revision, model.quantization,
                                                   vllm_config.load_config.download_dir),
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        layout_id=config.object_layout_id(vllm_config.cache_config.block_size),
        tp_size=parallel.tensor_parallel_size,
        chunk_size=config.chunk_size,
        layers_per_object=config.object_layers(max(stages), on_cpu=_on_cpu()),
        salt=config.salt,
        compute="" if config.share_across_platforms else compute_identity(vllm_config),
        attention=attention,
        kv_replicated=_replicated(model, parallel),
        pp_layers=",".join(map(str, stages)) if len(stages) > 1 else "",
        hash_algo=key_hash.resolve(config.hash_algo, getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)),
        config_inputs=config_inputs(vllm_config),
        compute_dtype=compute_dtype_name(model.dtype, dtype),
        digest_unit=_digest_unit(cache_groups, vllm_config.cache_config.block_size, config.chunk_size),
    )


def _digest_unit(cache_groups: CacheGroups | None, block_size: int, chunk_size: int) -> int:
    """The namespace's ``digest_unit``: tokens per token digest (the scheduler's, see keys/token_digests.py) where it is
    not the usual 16, else 0."""
    alignment = cache_groups.hit_alignment if cache_groups is not None else block_size
    unit = digest_unit(alignment, chunk_size)
    return 0 if unit == UNIT else unit


def pipeline_stages(model: Any, parallel: Any, dtype: str, cache_groups: CacheGroups | None) -> list[int]:
    """Each pipeline stage's layer count (vLLM's own split, ``get_pp_indices``); one stage without PP.

    Refuses what the stages could not key alike: each process sees only its
    own stage's layers, so per-layer facts that differ along the model (fp8
    scales, several KV cache groups) would give each stage other keys.
    """
    size = parallel.pipeline_parallel_size
    if size == 1:
        return [model.get_num_layers(parallel)]
    from vllm.distributed.utils import get_pp_indices

    why = ("an fp8 KV cache (its per-layer scales are known per stage only)" if is_fp8(dtype)
           else "several KV cache groups (hybrid attention: each stage sees only its own layers' groups)"
           if cache_groups is not None and cache_groups.multi else "")
    if why:
        raise ConfigError(f"KVCodecConnector supports pipeline parallelism (pipeline_parallel_size={size}) for bf16/fp16 "
                          f"caches of one KV cache group (full attention, one window, MLA), not {why}; "
                          "see docs/parallelism.md")
    total = model.get_total_num_hidden_layers()
    return [end - start for start, end in (get_pp_indices(total, r, size) for r in range(size))]


def _uniform_attention(cache_groups: CacheGroups | None, num_layers: int) -> str:
    """The whole model's attention kinds from one stage: with one KV cache group (what pipeline parallelism is
    supported for) every layer of every stage has that group's kind."""
    label = cache_groups.groups[0].label if cache_groups is not None and cache_groups.groups else FULL
    return "" if label == FULL else ",".join([label] * num_layers)


def _replicated(model: Any, parallel: Any) -> bool:
    """Whether every tensor-parallel rank holds the same KV: MLA's latent (one shared "head", which vLLM does not
    split across ranks) with TP > 1, unless decode context parallelism splits its tokens across them instead."""
    return (parallel.tensor_parallel_size > 1 and bool(getattr(model, "use_mla", False))
            and getattr(parallel, "decode_context_parallel_size", 1) == 1)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"


def _attention(cache_groups: CacheGroups | None, kv_cache_config: "KVCacheConfig | None") -> str:
    """Each layer's attention kind, in layer order ('' for all plain full attention): a window changes every KV."""
    if cache_groups is None or kv_cache_config is None:
        return ""
    names = sorted({n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}, key=layer_index)
    return cache_groups.attention(names)
