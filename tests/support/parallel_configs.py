"""The real connector in the scheduler role, built from real vLLM configs of a parallel deployment.

What the MLA, tensor- and pipeline-parallel suites share: a vLLM config of a
tiny model (no weights are ever loaded) at the given sizes, and a connector
whose lookups can be driven without an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.scheduler_harness import HEAD, KV_HEADS, LAYERS, layer_names, tiny_model_dir
from tests.support.tiny_models import tiny_model


def scheduler_connector(root: Path, model: str, tp: int, store: str, pp: int = 1, layers: int = LAYERS,
                        cache_dtype: str = "auto", **extra: Any) -> Any:
    """``model`` ("dsv2": MLA with 2 layers, or "llama": 2 KV heads and ``layers`` layers) at tensor parallel ``tp``
    and pipeline parallel ``pp``; ``extra`` goes to the connector's config."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from vllm_kvcodec.connector import KVCodecConnector

    folder = tiny_model(model, root) if model == "dsv2" else tiny_model_dir(root / model, layers)
    names = layer_names(LAYERS if model == "dsv2" else layers)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(folder), dtype="bfloat16", max_model_len=2048, skip_tokenizer_init=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True, cache_dtype=cache_dtype),
        kv_transfer_config=KVTransferConfig(kv_connector="KVCodecConnector", kv_role="kv_both",
                                            kv_connector_module_path="vllm_kvcodec.connector",
                                            kv_connector_extra_config={"store": store, "codec": "raw", **extra}),
        device_config=DeviceConfig("cpu"),
    )
    dtype = torch.float8_e4m3fn if cache_dtype.startswith("fp8") else torch.bfloat16
    if model == "dsv2":
        spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=dtype)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    with set_current_vllm_config(vllm_config):
        return KVCodecConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def matched(conn: Any, tokens: list[int]) -> int:
    """Tokens the connector offers a new request of ``tokens`` (a new request id: a fresh lookup)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    matched.calls = getattr(matched, "calls", 0) + 1
    return conn.get_num_new_matched_tokens(Request(f"r{matched.calls}", tokens, SamplingParams(max_tokens=1), None), 0)[0]


def put(url: str, keys: list[str]) -> None:
    """Objects under ``keys`` (the lookup asks whether objects exist, not what they hold)."""
    from storage import open_store

    with open_store(url) as store:
        for key in keys:
            store.put(key, b"x")
