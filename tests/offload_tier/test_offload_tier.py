"""KVCodecTier inside vLLM's OffloadingConnector, without CUDA, the way vLLM tests its own tiers.

Each engine is vLLM's own scheduler side (tests/support/offload_engine.py): a
real VllmConfig of SmolLM2, vLLM's TieringOffloadingSpec and CPU primary tier,
the tier made by SecondaryTierFactory, vLLM Requests whose offload keys and
positions vLLM's scheduler half makes. Rows hold real SmolLM2-135M KV of the
prompt, one 16-token block each, as a FlashAttention CPU copy lays it out: per
layer, the block's K then V, ``[2, block_size, kv_heads, head_dim]`` bf16.
A round trip goes through vLLM's tiering manager (store, cascade, lookup,
promotion); the failure cases call the tier's jobs directly, as that manager
does, into rows of the primary tier's memory. Every load is compared bit for bit.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from storage import open_store
from tests.offload_tier.conftest import ROWS
from tests.support.offload_engine import BLOCK, OffloadEngine, scheduler_connector, tier_config, vllm_config
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.offload_tier import KVCodecTier

SRC, DST = 0, 16  # first rows of the primary tier's memory that direct jobs read from and load into


def job(job_id: int, keys: list, chunk_ids: list[int], context: ReqContext, promotion: bool = False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64), is_promotion=promotion,
                       req_context=context)


def finished(tier: KVCodecTier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def looked_up(tier: KVCodecTier, keys: list, context: ReqContext, timeout: float = 30.0) -> list[LookupResult]:
    """One full async lookup cycle, as the scheduler drives it: ask, end the step, ask again until answered."""
    results = [tier.lookup(k, context) for k in keys]
    deadline = time.monotonic() + timeout
    while LookupResult.RETRY in results and time.monotonic() < deadline:
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.02)
        results = [tier.lookup(k, context) for k in keys]
    return results


def stored_directly(e: OffloadEngine, tokens: list[int], blocks: torch.Tensor, n: int) -> list:
    """The prompt's first ``n`` blocks in rows SRC.., stored by one job; their keys."""
    req = e.request(tokens)
    keys = e.keys(req)[:n]
    e.rows[SRC : SRC + n, : blocks.shape[1]] = blocks[:n]
    e.tier.submit_store(job(1, keys, list(range(SRC, SRC + n)), e.context(req)))
    assert [r.success for r in finished(e.tier)] == [True]
    return keys


def row(e: OffloadEngine, chunk: int, width: int) -> torch.Tensor:
    return e.rows[chunk, :width]


def test_rows_round_trip_bit_exact_and_compressed_between_two_engines(engine, tokens, blocks) -> None:
    store = f"memory://offload-{uuid.uuid4().hex}"
    a = engine(store)
    assert isinstance(a.tier, KVCodecTier)
    req = a.request(tokens)
    assert a.hit_tokens(req) == 0
    a.save(req, blocks[:4])
    assert a.tier.counters["stored_rows"] == 4
    assert a.tier.counters["stored_bytes"] * 1.2 < 4 * a.tier.block_size_bytes  # real KV, compressed losslessly
    assert [a.tier.lookup(k, a.context(req)) for k in a.keys(req)[:4]] == [LookupResult.HIT] * 4  # known at once
    b = engine(store)  # another engine, same model: finds and loads them
    again = b.request(tokens)
    assert b.hit_tokens(again) == 4 * BLOCK
    assert b.tier.counters["loaded_rows"] == 4
    assert torch.equal(b.loaded_rows(again, 4)[:, : blocks.shape[1]], blocks[:4])


def test_jobs_run_in_the_background_and_report_through_get_finished_jobs(engine, tokens, blocks) -> None:
    e = engine(f"link+memory://offload-{uuid.uuid4().hex}?gbps=1&rtt_ms=1500")
    req = e.request(tokens)
    e.rows[SRC, : blocks.shape[1]] = blocks[0]
    e.tier.submit_store(job(1, e.keys(req)[:1], [SRC], e.context(req)))  # returns before its put (a 1.5 s trip)
    assert list(e.tier.get_finished_jobs()) == [] and e.tier.has_pending_work()
    assert [r.success for r in finished(e.tier)] == [True]
    assert not e.tier.has_pending_work()


def test_a_row_the_store_evicted_fails_alone_and_becomes_a_miss(engine, tokens, blocks, tmp_path: Path) -> None:
    store = f"file://{tmp_path}/offload"
    a = engine(store)
    keys = stored_directly(a, tokens, blocks, 4)
    with open_store(store) as s:  # the store evicts one (as a capped store or Redis maxmemory would)
        s.delete(a.tier.key_of(keys[2]))
    b = engine(store)
    req = b.request(tokens)
    context, width = b.context(req), blocks.shape[1]
    assert looked_up(b.tier, keys[1:3], context) == [LookupResult.HIT, LookupResult.MISS]
    assert looked_up(b.tier, keys[3:4], context) == [LookupResult.HIT]
    b.tier.submit_load(job(2, keys, list(range(DST, DST + 4)), context, promotion=True))
    [result] = finished(b.tier)
    assert not result.success and set(result.successful_keys) == {keys[0], keys[1], keys[3]}
    for i in (0, 1, 3):
        assert torch.equal(row(b, DST + i, width), blocks[i])
    assert not row(b, DST + 2, width).any()
    assert b.tier.lookup(keys[2], context) == LookupResult.MISS and b.tier.lookup(keys[3], context) == LookupResult.HIT
    assert b.tier.counters["load_failures"] == 1


def test_a_capped_store_evicts_and_lookups_follow(engine, tokens, blocks, tmp_path: Path) -> None:
    store = f"file://{tmp_path}/capped?max_bytes={int(blocks.shape[1] * 2.2)}"
    a = engine(store)
    req = a.request(tokens)
    keys = a.keys(req)
    for i in range(ROWS):
        a.rows[SRC + i, : blocks.shape[1]] = blocks[i]
        a.tier.submit_store(job(i, keys[i : i + 1], [SRC + i], a.context(req)))
        assert finished(a.tier)[0].success
    b = engine(store)
    found = looked_up(b.tier, keys, b.context(b.request(tokens)))
    assert found.count(LookupResult.HIT) < ROWS and found[-1] == LookupResult.HIT  # the latest survive


@pytest.mark.parametrize("fault", ["corrupt=1", "swap=1", "truncate=1"])
def test_damaged_or_misplaced_objects_fail_their_rows_and_write_nothing(engine, tokens, blocks, fault: str) -> None:
    from storage.testing.faults import find_fault_injector

    name = f"offload-{uuid.uuid4().hex}"
    keys = stored_directly(engine(f"memory://{name}"), tokens, blocks, 4)
    b = engine(f"faults+memory://{name}?seed=5&{fault}")
    context, width = b.context(b.request(tokens)), blocks.shape[1]
    assert looked_up(b.tier, keys, context) == [LookupResult.HIT] * 4  # the scheduler looks up before it loads
    b.tier.submit_load(job(2, keys, list(range(DST, DST + 4)), context, promotion=True))
    [result] = finished(b.tier)
    injected = sum(v for k, v in find_fault_injector(b.tier.store.inner).counts().items() if k != "reads")
    loaded = set(result.successful_keys or ())
    assert not result.success and injected >= 1 and len(loaded) == 4 - injected
    for i in range(4):  # a row is the right bytes, or untouched
        r = row(b, DST + i, width)
        assert torch.equal(r, blocks[i]) if keys[i] in loaded else not r.any()
        assert b.tier.lookup(keys[i], context) == (LookupResult.HIT if keys[i] in loaded else LookupResult.MISS)


def test_a_store_that_is_down_fails_jobs_without_raising(engine, tokens) -> None:
    e = engine("faults+memory://?down=1")
    req = e.request(tokens)
    keys, context = e.keys(req), e.context(req)
    e.tier.submit_store(job(1, keys[:1], [SRC], context))
    e.tier.submit_load(job(2, keys[1:2], [DST], context, promotion=True))
    assert sorted((r.job_id, r.success) for r in finished(e.tier)) == [(1, False), (2, False)]
    assert looked_up(e.tier, keys[:1], context) == [LookupResult.MISS]  # a lookup that failed is a miss


def test_a_bad_channel_count_is_one_clear_error(engine) -> None:
    with pytest.raises(ConfigError, match="channels"):
        engine("memory://", tier={"channels": 7})


def test_under_vllms_plain_offloading_connector_the_tier_refuses_to_start() -> None:
    """vLLM's own connector gives its tiers the model's name and no tokens: too little to key or prove a row by."""
    with pytest.raises(ConfigError, match="kv_connector to KVCodecOffloadingConnector"):
        scheduler_connector(vllm_config([tier_config("memory://")], connector="OffloadingConnector"))
