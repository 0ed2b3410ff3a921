"""Where a worker stands in the engine's parallel layout, and how many workers save and load each chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvcodec.keys.chain import Namespace, stored_ranks

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def saving_workers(namespace: Namespace) -> int:
    """How many workers report each chunk's save: every stage's saving ranks (one per stage for a replicated
    latent, whose other ranks only load)."""
    return len(stored_ranks(namespace, namespace.tp_size)) * len(namespace.stages())


def loading_workers(vllm_config: "VllmConfig") -> int:
    """How many workers report each load: all of them (each stage's TP ranks, a replicated latent's too: every
    rank loads its copy), one report each, which vLLM's ``KVOutputAggregator`` hands the scheduler as it counts
    their ``finished_recving`` (``world_size`` of them: this connector names no other count)."""
    return vllm_config.parallel_config.world_size


def pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except (AssertionError, ImportError, RuntimeError):
        return 0


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, RuntimeError):
        return 0
