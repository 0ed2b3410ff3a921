"""LMCache's MP storage stack built the way its server builds it, for the lmcache_mp tests.

``--l2-adapter`` JSON -> LMCache's own argument parsing (``add_storage_manager_args``,
``parse_args_to_config``) -> ``StorageManager`` (L1 manager, store / prefetch / eviction
controllers, ``SerdeL2AdapterWrapper`` around any adapter with a ``serde``). The
steps a test drives are LMCache's public StorageManager calls: ``reserve_write`` /
``finish_write`` (store to L1, which the store controller writes through to L2),
``clear`` (L1 evicted), ``submit_prefetch_task`` (L2 -> serde -> L1) and
``read_prefetched_results``. The same sequence as LMCache's own
tests/v1/distributed/serde/test_serde_fs_e2e.py, with real KV instead of random.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
from lmcache.v1.distributed.storage_manager import StorageManager

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def mp_layout(chunk: torch.Tensor) -> torch.Tensor:
    """A canonical ``[layers, 2, tokens, heads, dim]`` chunk in LMCache MP's ``[2, layers, tokens, heads*dim]``."""
    layers, _, tokens, heads, dim = chunk.shape
    return chunk.permute(1, 0, 2, 3, 4).reshape(2, layers, tokens, heads * dim).contiguous()


def keys_for(n: int, tag: int = 0, model: str = MODEL) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=bytes([tag, i]) * 16, model_name=model, kv_rank=0) for i in range(n)]


def layout_of(tensor: torch.Tensor) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[tensor.shape], dtypes=[tensor.dtype])


def plugin_adapter(store: str, serde: dict | None = None, **params: object) -> dict:
    spec: dict = {"type": "plugin", "module_path": "vllm_kvcodec.lmcache_mp", "class_name": "KVCodecL2Adapter",
                  "adapter_params": {"store": store, **params}}
    if serde is not None:
        spec["serde"] = serde
    return spec


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@contextmanager
def storage_manager(*adapters: dict, l1_gb: float = 0.25) -> Iterator[StorageManager]:
    """A StorageManager from ``--l2-adapter`` JSON specs, closed afterwards."""
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    argv = ["--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU"]
    for spec in adapters:
        argv += ["--l2-adapter", json.dumps(spec)]
    sm = StorageManager(parse_args_to_config(parser.parse_args(argv)))
    try:
        yield sm
    finally:
        sm.close()


def store(sm: StorageManager, keys: list[ObjectKey], tensors: list[torch.Tensor]) -> None:
    """Write ``tensors`` into L1 and wait until the store controller has handed every one to L2 (stored or failed)."""
    reserved = sm.reserve_write(keys, layout_of(tensors[0]))
    assert len(reserved) == len(keys), "L1 could not reserve every object"
    for key, tensor in zip(keys, tensors, strict=True):
        reserved[key].get_tensor(0).copy_(tensor)
    sm.finish_write(keys)
    assert wait_for(lambda: _settled(sm)), "store controller never settled"


def _settled(sm: StorageManager, quiet_s: float = 1.0) -> bool:
    """The store path idle for ``quiet_s`` on end: nothing pending or in flight, no serde temp or read lock in L1.

    LMCache reports no per-key store outcome (a failed serialize is only logged), so
    a test waits for quiet instead; what was stored is then checked in L2 itself.
    """
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        status = sm.report_status()
        store, l1 = status["store_controller"], status["l1_manager"]
        if store["in_flight_task_count"] or store["pending_keys_count"] or l1["temporary_count"] or l1["read_locked_count"]:
            return False
        time.sleep(0.05)
    return True


def evict_l1(sm: StorageManager) -> None:
    sm.clear(force=True)
    assert sm.report_status()["l1_manager"]["total_object_count"] == 0


def fetch(sm: StorageManager, keys: list[ObjectKey], like: torch.Tensor) -> list[torch.Tensor | None]:
    """Prefetch ``keys`` from L2 into L1 and copy out what arrived (None for a key not hit), releasing every lock."""
    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout_of(like))],
                            fetching_policy="full")
    handle = sm.submit_prefetch_task(spec)
    assert sm.wait_prefetch_status(handle, timeout=120.0), "prefetch never completed"
    result = sm.query_prefetch_status(handle)
    hits = [key for i, key in enumerate(keys) if result.hit_cells[0].test(i)]
    out: dict[ObjectKey, torch.Tensor] = {}
    if hits:
        with sm.read_prefetched_results(hits, l1_owners=result.l1_owners) as objs:
            assert objs is not None
            for key, obj in zip(hits, objs, strict=True):
                out[key] = obj.get_tensor(0).clone()
        sm.finish_read_prefetched(hits, l1_owners=result.l1_owners)
    return [out.get(k) for k in keys]


def l1_drained(sm: StorageManager) -> bool:
    """No L1 memory left in use once every lock is released (serde temp buffers included)."""
    return wait_for(lambda: sm.report_status()["l1_manager"]["memory_used_bytes"] == 0, timeout=10.0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
