"""Where the tier keeps a block: vLLM's offload key inside a namespace of what the block's bytes mean.

Why a namespace: vLLM's offload key is a hash of tokens; two engines with the
same tokens but another model, KV dtype, block geometry, parallel layout or
CPU-tier row size hold different bytes under it. The namespace digest covers
everything in vLLM's :class:`OffloadingConfig` that shapes a CPU-tier row (not
the rank: the scheduler's view of a row holds every worker's pages), so a
block is only ever loaded by an engine that lays it out the same way.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm_kvcodec.dtypes import DType

#: Version of the row format: bump when what a stored row holds changes.
ROW_FORMAT = "kvcodec-offload-row/1"
KEY_ROOT = "kvc/offload"


def namespace_fields(config: Any, row_bytes: int, salt: str = "") -> dict[str, Any]:
    """What a CPU-tier row's bytes depend on, from vLLM's ``OffloadingConfig`` (``offloading_spec.config``)."""
    p = config.parallel
    return {
        "format": ROW_FORMAT, "salt": salt, "model": config.model.name, "dtype": DType.parse(config.model.dtype).name,
        "row_bytes": row_bytes, "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash, "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "parallel": [p.world_size, p.tp_size, p.pp_size, p.pcp_size, p.dcp_size, p.is_parallelism_agnostic],
        "replicated_layout": getattr(config, "replicated_layout", False),
        "canonical_layout": getattr(config, "canonical_layout", False),
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
    }


def namespace_digest(fields: dict[str, Any]) -> str:
    """A stable digest (same on every host and Python version: canonical JSON, BLAKE2b-128)."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).hexdigest()


def store_key(digest: str, offload_key: bytes) -> str:
    """``kvc/offload/<namespace digest>/<offload key hex>``: printable ASCII, well under the store key limit."""
    return f"{KEY_ROOT}/{digest}/{bytes(offload_key).hex()}"
