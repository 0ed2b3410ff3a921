"""vLLM's OffloadingConnector with KVCodecTier as vLLM's scheduler builds and drives it, on a machine with no GPU.

The scheduler side is vLLM's own: a ``VllmConfig`` made by ``EngineArgs`` from a
real model folder (SmolLM2's, or a copy of it), vLLM's
``build_offloading_config`` and ``TieringOffloadingSpec``, its CPU primary tier
in shared memory, its tiering manager cascading to and promoting from
KVCodecTier (made by ``SecondaryTierFactory`` from the tier config), and vLLM
``Request``\\ s hashed by vLLM's block hasher, whose offload keys and key
positions vLLM's scheduler half makes. Only the worker is missing (its
GPU<->CPU copies need CUDA): :meth:`OffloadEngine.save` writes rows into the
primary tier's memory as that copy would and completes the store as the
worker's report would, which cascades them to KVCodecTier;
:meth:`OffloadEngine.hit_tokens` asks the scheduler's question
(``get_num_new_matched_tokens``) until it is answered, with the steps between
that promote rows from KVCodecTier into the primary tier.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import torch

BLOCK = 16  # tokens per GPU block, per offloaded chunk and per vLLM block hash
NUM_BLOCKS = 64
CPU_BYTES = 12 << 20  # the primary tier: about 34 rows of SmolLM2's 16-token blocks


def tier_config(store: str, **options: Any) -> dict[str, Any]:
    return {"type": "KVCodecTier", "module_path": "vllm_kvcodec.offload_tier", "store": store, "io_threads": 2,
            **options}


def vllm_config(tiers: list[dict[str, Any]], model: Path | None = None,
                connector: str = "KVCodecOffloadingConnector", **engine_args: Any) -> Any:
    """What ``vllm serve MODEL --kv-transfer-config ...`` makes of docs/tiers.md's configuration."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvcodec.tools.smollm2 import model_dir

    transfer = {"kv_connector": connector, "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES,
                                              "secondary_tiers": tiers}}
    if connector != "OffloadingConnector":
        transfer["kv_connector_module_path"] = "vllm_kvcodec.offload_tier"
    args = {"model": str(model or model_dir()), "dtype": "bfloat16", "block_size": BLOCK, "max_model_len": 2048,
            "enable_prefix_caching": True, "enforce_eager": True, "kv_transfer_config": transfer, **engine_args}
    return EngineArgs(**args).create_engine_config()


def kv_cache_config(config: Any) -> Any:
    """One full-attention group of every layer, as vLLM's KV cache manager makes for SmolLM2."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model, parallel = config.model_config, config.parallel_config
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(parallel))]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=model.get_num_kv_heads(parallel),
                             head_size=model.get_head_size(), dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def scheduler_connector(config: Any) -> Any:
    """The connector's scheduler half as vLLM's ``Scheduler`` creates it (``KVConnectorFactory``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config(config))


class OffloadEngine:
    """One engine's scheduler side with KVCodecTier on ``store``; ``engine_args`` as ``EngineArgs`` takes them."""

    def __init__(self, store: str, model: Path | None = None, tier: dict[str, Any] | None = None,
                 **engine_args: Any) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.config = vllm_config([tier_config(store, **(tier or {}))], model, **engine_args)
        self.connector = scheduler_connector(self.config)
        self.manager = self.connector.connector_scheduler.manager
        [self.tier] = self.manager.secondary_tiers
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as vLLM's EngineCore does
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        view = self.tier._primary_kv_view  # the primary tier's memory, as vLLM hands it to the tier
        self.rows = torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(-1, self.tier.block_size_bytes)

    def request(self, tokens: list[int], **params: Any) -> Any:
        """A new vLLM request, announced to the connector as vLLM's scheduler does (``add_request``)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(f"req-{uuid.uuid4().hex[:8]}", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=self.block_hasher, **params)
        self.connector.on_new_request(req)
        return req

    def _state(self, req: Any) -> Any:
        return self.connector.connector_scheduler._req_status[req.request_id]

    def context(self, req: Any) -> Any:
        """The ``ReqContext`` vLLM's scheduler half made for ``req`` (what every tier call of it carries), with the
        positions of its keys, as that half records them before it asks the tiers of them."""
        state = self._state(req)
        state.update_offload_keys()
        return state.req_context

    def keys(self, req: Any) -> list[bytes]:
        """The request's offload keys, one per full block (vLLM's own, their positions recorded in its context)."""
        self.context(req)
        return list(self._state(req).group_states[0].offload_keys)

    def save(self, req: Any, rows: torch.Tensor) -> None:
        """The request's first blocks computed (``rows``: one row of bytes per block) and offloaded: into the
        primary tier as the worker's copy would, then cascaded to KVCodecTier when the store completes."""
        context = self.context(req)
        keys = self.keys(req)[: len(rows)]
        out = self.manager.prepare_store(keys, context)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(chunk), : rows.shape[1]] = rows[keys.index(key)]
        self.manager.complete_store(out.keys_to_store, context)
        self.settle()

    def settle(self) -> None:
        """Let the tier's jobs finish, then end a scheduler step (vLLM collects them and flushes promotions)."""
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.tier.drain_jobs()
        for _ in range(2):  # vLLM collects finished jobs once per step, at its first call: the next step's end at last
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def hit_tokens(self, req: Any, timeout: float = 30.0) -> int:
        """What the scheduler is told it can load for ``req`` (nothing computed locally), once the tiers answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit, _ = self.connector.get_num_new_matched_tokens(req, 0)
            if hit is not None:
                return hit
            self.settle()
            time.sleep(0.01)
        raise TimeoutError(f"no answer for {req.request_id} in {timeout} s")

    def loaded_rows(self, req: Any, blocks: int) -> torch.Tensor:
        """The primary tier's rows of the request's first ``blocks`` blocks, as the worker would copy them out."""
        context = self.context(req)
        keys = self.keys(req)[:blocks]
        spec = self.manager.prepare_load(keys, context)
        try:
            return self.rows[torch.as_tensor(spec.chunk_ids, dtype=torch.long)].clone()
        finally:
            self.manager.complete_load(keys, context)

    def shutdown(self) -> None:
        del self.rows  # a view of the shared memory vLLM unmaps
        self.connector.shutdown()
