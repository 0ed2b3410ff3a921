"""Where the tier keeps a block: vLLM's offload key inside the connector's namespace of what the block's bytes mean.

vLLM's offload key is its prefix cache's block hash (with the block's KV cache
group): a chain over the token ids and the request's LoRA name and path, media
hashes and ``cache_salt``, under vLLM's hash algorithm and seed. It names a
prefix, not its KV: engines with other weights under the same model name (a
fine-tune deployed at the same path), other ``hf_overrides``, kernels, KV dtype,
row geometry or parallel layout hold other bytes under the same key. So the
namespace is the connector's own (:class:`~vllm_kvcodec.keys.chain.Namespace`, built
with the connector's identity functions: the weights fingerprint, the model
config inputs, the compute identity), with the CPU-tier row's geometry as its
layout (not the rank: a scheduler row holds every worker's pages), and a block
is only ever loaded by an engine that computes and lays it out the same way.
Its key chain, one link per vLLM block, is what each row's token digests hang
off (proofs.py); it is SHA-256 whatever vLLM hashes its own blocks with.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from vllm_kvcodec.keys import key_hash
from vllm_kvcodec.connector.cache_identity import cache_dtype_name, compute_dtype_name
from vllm_kvcodec.keys.identity import compute_identity, config_inputs, model_identity
from vllm_kvcodec.keys.chain import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_offload.config import OffloadingConfig

#: Version of the row format: bump when what a stored row holds changes (2: its tokens' digests).
ROW_FORMAT = "kvcodec-offload-row/2"
KEY_ROOT = "kvc/offload"


def tier_namespace(vllm_config: "VllmConfig", config: "OffloadingConfig", row_bytes: int, salt: str = "") -> Namespace:
    """Everything that must match for two engines' tiers to share rows: the connector's identity, this row layout."""
    model = vllm_config.model_config
    layers = model.get_total_num_hidden_layers()
    dtype = cache_dtype_name(vllm_config.cache_config.cache_dtype, model.dtype)
    return Namespace(
        model_id=model_identity(model.model, model.revision, model.quantization),
        dtype=dtype,
        compute_dtype=compute_dtype_name(model.dtype, dtype),
        num_layers=layers,
        num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        layout_id=f"{ROW_FORMAT}:{_digest(row_geometry(config, row_bytes))}",
        tp_size=config.parallel.tp_size,
        chunk_size=config.cache.tokens_per_hash,  # a link, and a token digest, per vLLM block hash
        layers_per_object=layers,
        salt=salt,
        compute=compute_identity(vllm_config),
        hash_algo=key_hash.SHA256,
        config_inputs=config_inputs(vllm_config),
    )


def row_geometry(config: "OffloadingConfig", row_bytes: int) -> dict[str, Any]:
    """What a CPU-tier row's layout depends on, from vLLM's ``OffloadingConfig`` (``offloading_spec.config``)."""
    p = config.parallel
    return {
        "row_bytes": row_bytes, "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash, "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "parallel": [p.world_size, p.tp_size, p.pp_size, p.pcp_size, p.dcp_size, p.is_parallelism_agnostic],
        "replicated_layout": getattr(config, "replicated_layout", False),
        "canonical_layout": getattr(config, "canonical_layout", False),
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
    }


def _digest(fields: dict[str, Any]) -> str:
    """A stable digest (same on every host and Python version: canonical JSON, SHA-256)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def store_key(namespace: Namespace, offload_key: bytes) -> str:
    """``kvc/offload/<namespace digest>/<offload key hex>``: printable ASCII, well under the store key limit."""
    return f"{KEY_ROOT}/{namespace.digest[:32]}/{bytes(offload_key).hex()}"
