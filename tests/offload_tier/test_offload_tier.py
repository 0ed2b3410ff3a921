"""KVCodecTier through vLLM's secondary-tier interface, without CUDA, the way vLLM tests its own tiers.

The primary tier is a page-aligned buffer of rows, viewed as vLLM's CPU tier
hands it to secondary tiers (a 2-D memoryview, ``strides[0]`` bytes per row).
Each row holds one offloaded block of real SmolLM2-135M KV as a FlashAttention
CPU copy lays it out: per layer, the block's K then V, ``[2, block_size,
kv_heads, head_dim]`` bf16. Jobs go in through ``submit_store`` /
``submit_load``, come back through ``get_finished_jobs``; lookups run on vLLM's
own async lookup thread. Every load is compared bit for bit.
"""

from __future__ import annotations

import mmap
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from storage import open_store
from vllm_kvcodec.offload_tier import KVCodecTier

BLOCK = 16  # tokens per offloaded block
ROWS = 8
CTX = ReqContext(req_id="r0")


def offloading_spec(model: str = "SmolLM2-135M-Instruct") -> SimpleNamespace:
    """What a tier reads from vLLM's OffloadingSpec: its (real) OffloadingConfig."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=tuple(f"layers.{i}" for i in range(30)),
                                      group_id=0),),
        worker_kv_bytes_per_block=BLOCK * 23040, enable_kv_cache_events=False, extra_config={},
        engine_id="test-engine", model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))
    return SimpleNamespace(config=config, blocks_per_chunk=1)


def rows_of(kv: torch.Tensor) -> torch.Tensor:
    """Blocks of ``kv`` [layers, 2, tokens, heads, dim] as CPU-tier rows, in a page-aligned buffer."""
    layers, _, tokens, heads, dim = kv.shape
    blocks = kv.reshape(layers, 2, tokens // BLOCK, BLOCK, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()
    row_bytes = blocks[0].numel() * 2
    assert row_bytes % mmap.PAGESIZE == 0
    raw = torch.zeros(ROWS * row_bytes + mmap.PAGESIZE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % mmap.PAGESIZE
    buffer = raw[shift : shift + ROWS * row_bytes].view(torch.bfloat16).view(ROWS, row_bytes // 2)
    n = min(ROWS, blocks.shape[0])
    buffer[:n] = blocks[:n].reshape(n, -1)
    return buffer


def make_tier(buffer: torch.Tensor, store: str, model: str = "SmolLM2-135M-Instruct", **options: object) -> KVCodecTier:
    return SecondaryTierFactory.create_secondary_tier(
        {"type": "KVCodecTier", "module_path": "vllm_kvcodec.offload_tier", "store": store, "io_threads": 2, **options},
        memoryview(buffer.view(torch.uint8).numpy()), offloading_spec(model))  # bytes, as the CPU tier views its mmap


def key(n: int):
    return make_offload_key(n.to_bytes(32, "big"), 0)


def job(job_id: int, keys: list, chunk_ids: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64), is_promotion=promotion,
                       req_context=CTX)


def finished(tier: KVCodecTier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def looked_up(tier: KVCodecTier, keys: list, timeout: float = 30.0) -> list[LookupResult]:
    """One full async lookup cycle, as the scheduler drives it: ask, end the step, ask again until answered."""
    results = [tier.lookup(k, CTX) for k in keys]
    deadline = time.monotonic() + timeout
    while LookupResult.RETRY in results and time.monotonic() < deadline:
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.02)
        results = [tier.lookup(k, CTX) for k in keys]
    return results


@pytest.fixture
def rows(real_kv_1k: torch.Tensor) -> torch.Tensor:
    return rows_of(real_kv_1k[:, :, : ROWS * BLOCK])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_rows_round_trip_bit_exact_and_compressed_between_two_engines(rows: torch.Tensor) -> None:
    store = f"memory://offload-{uuid.uuid4().hex}"
    source = rows.clone()
    a = make_tier(rows, store)
    try:
        assert isinstance(a, KVCodecTier)
        a.submit_store(job(1, [key(i) for i in range(4)], [0, 1, 2, 3]))
        assert [(r.job_id, r.success) for r in finished(a)] == [(1, True)]
        assert [a.lookup(key(i), CTX) for i in range(4)] == [LookupResult.HIT] * 4  # stored here: known at once
        assert a.counters["stored_rows"] == 4
        assert a.counters["stored_bytes"] * 1.2 < 4 * a.block_size_bytes  # real KV, compressed losslessly
    finally:
        a.shutdown()
    other = torch.zeros_like(rows)  # another engine, same model: finds and loads them
    b = make_tier(other, store)
    try:
        assert looked_up(b, [key(0), key(3), key(9)]) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        b.submit_load(job(2, [key(0), key(3)], [5, 6], promotion=True))
        [result] = finished(b)
        assert result.success and result.successful_keys is None
        assert torch.equal(bits(other[5]), bits(source[0])) and torch.equal(bits(other[6]), bits(source[3]))
        assert not other[:5].any() and not other[7:].any()  # nothing else written
    finally:
        b.shutdown()


def test_another_model_sees_none_of_them(rows: torch.Tensor) -> None:
    store = f"memory://offload-{uuid.uuid4().hex}"
    a = make_tier(rows, store)
    a.submit_store(job(1, [key(0)], [0]))
    assert finished(a)[0].success
    a.shutdown()
    b = make_tier(torch.zeros_like(rows), store, model="another-model")
    try:
        assert looked_up(b, [key(0)]) == [LookupResult.MISS]
    finally:
        b.shutdown()


def test_jobs_run_in_the_background_and_report_through_get_finished_jobs(rows: torch.Tensor) -> None:
    store = f"link+memory://offload-{uuid.uuid4().hex}?gbps=1&rtt_ms=1500"
    tier = make_tier(rows, store)
    try:
        tier.submit_store(job(1, [key(0)], [0]))  # returns before its put (which waits out a 1.5 s round trip)
        assert list(tier.get_finished_jobs()) == [] and tier.has_pending_work()
        assert [r.success for r in finished(tier)] == [True]
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_a_row_the_store_evicted_fails_alone_and_becomes_a_miss(rows: torch.Tensor, tmp_path: Path) -> None:
    source = rows.clone()
    store = f"file://{tmp_path}/offload"
    a = make_tier(rows, store)
    a.submit_store(job(1, [key(i) for i in range(4)], [0, 1, 2, 3]))
    assert finished(a)[0].success
    a.shutdown()
    with open_store(store) as s:  # the store evicts one (as a capped store or Redis maxmemory would)
        s.delete(f"kvc/offload/{a.digest}/{bytes(key(2)).hex()}")
    other = torch.zeros_like(rows)
    b = make_tier(other, store)
    try:
        assert looked_up(b, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.MISS]
        assert looked_up(b, [key(3)]) == [LookupResult.HIT]
        b.submit_load(job(2, [key(0), key(1), key(2), key(3)], [4, 5, 6, 7], promotion=True))
        [result] = finished(b)
        assert not result.success and set(result.successful_keys) == {key(0), key(1), key(3)}
        for dst, src in ((4, 0), (5, 1), (7, 3)):
            assert torch.equal(bits(other[dst]), bits(source[src]))
        assert not other[6].any()
        assert b.lookup(key(2), CTX) == LookupResult.MISS and b.lookup(key(3), CTX) == LookupResult.HIT
        assert b.counters["load_failures"] == 1
    finally:
        b.shutdown()


def test_a_capped_store_evicts_and_lookups_follow(rows: torch.Tensor, tmp_path: Path) -> None:
    store = f"file://{tmp_path}/capped?max_bytes={int(rows[0].numel() * 2 * 2.2)}"
    a = make_tier(rows, store)
    for i in range(ROWS):
        a.submit_store(job(i, [key(i)], [i]))
        assert finished(a)[0].success
    a.shutdown()
    b = make_tier(torch.zeros_like(rows), store)
    try:
        found = looked_up(b, [key(i) for i in range(ROWS)])
        assert found.count(LookupResult.HIT) < ROWS and found[-1] == LookupResult.HIT  # the latest survive
    finally:
        b.shutdown()


@pytest.mark.parametrize("fault", ["corrupt=1", "swap=1", "truncate=1"])
def test_damaged_or_misplaced_objects_fail_their_rows_and_write_nothing(rows: torch.Tensor, fault: str) -> None:
    from storage.testing.faults import find_fault_injector

    name = f"offload-{uuid.uuid4().hex}"
    source = rows.clone()
    a = make_tier(rows, f"memory://{name}")
    a.submit_store(job(1, [key(i) for i in range(4)], [0, 1, 2, 3]))
    assert finished(a)[0].success
    a.shutdown()
    other = torch.zeros_like(rows)
    b = make_tier(other, f"faults+memory://{name}?seed=5&{fault}")
    try:
        keys = [key(i) for i in range(4)]
        assert looked_up(b, keys) == [LookupResult.HIT] * 4  # the scheduler looks up before it loads
        b.submit_load(job(2, keys, [4, 5, 6, 7], promotion=True))
        [result] = finished(b)
        injected = sum(v for k, v in find_fault_injector(b.store.inner).counts().items() if k != "reads")
        loaded = set(result.successful_keys or ())
        assert not result.success and injected >= 1 and len(loaded) == 4 - injected
        for i in range(4):  # a row is the right bytes, or untouched
            row = other[4 + i]
            assert torch.equal(bits(row), bits(source[i])) if keys[i] in loaded else not row.any()
            assert b.lookup(keys[i], CTX) == (LookupResult.HIT if keys[i] in loaded else LookupResult.MISS)
    finally:
        b.shutdown()


def test_a_store_that_is_down_fails_jobs_without_raising(rows: torch.Tensor) -> None:
    tier = make_tier(rows, "faults+memory://?down=1")
    try:
        tier.submit_store(job(1, [key(0)], [0]))
        tier.submit_load(job(2, [key(1)], [1], promotion=True))
        assert sorted((r.job_id, r.success) for r in finished(tier)) == [(1, False), (2, False)]
        assert looked_up(tier, [key(0)]) == [LookupResult.MISS]  # a lookup that failed is a miss
    finally:
        tier.shutdown()


def test_a_bad_channel_count_is_one_clear_error(rows: torch.Tensor) -> None:
    from vllm_kvcodec.errors import ConfigError

    with pytest.raises(ConfigError, match="channels"):
        make_tier(rows, "memory://", channels=7)
