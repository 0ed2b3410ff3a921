"""The connector through vLLM's whole request lifecycle, step by step in vLLM's real Scheduler.

Every scenario runs on :mod:`tests.support.scheduler_harness`: a real ``Scheduler``
and the connector's real worker half over real paged KV, a real file store,
a fake model whose KV is a function of the prefix. Each step checks the
plans against the block tables and that every request reads the right KV;
each test ends with nothing leaked. What a scenario adds is the lifecycle
event (a failed load, an abort, a preemption, a burst, a second turn) and
what must follow from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, Violation, loaded_tokens, loads_of, prompt, reload, saved_by

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]


#: vLLM's two ways of stepping: the output of step N before step N+1 is scheduled, or after (async scheduling).
SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])


#: For tests that reach one store through two URLs (plain, and behind ``link+`` or ``faults+``): the default
#: layers per object follow the URL (one object per chunk for a local store, layer groups behind an emulated
#: network), and both engines must key chunks alike.
SAME_OBJECTS = {"layers_per_object": 1}


def make(tmp_path: Path, store: str, pipelined: bool = False, **kw: Any) -> Engine:
    return Engine(tmp_path, store, async_scheduling=pipelined, **kw)


def stored(tmp_path: Path, store: str, tokens: list[int], pipelined: bool = False, **kw: Any) -> None:
    """One engine computes ``tokens`` and saves its chunks, then goes away."""
    saved_by(tmp_path, store, tokens, async_scheduling=pipelined, **kw)


def object_keys(engine: Engine, tokens: list[int], chunk: int) -> list[str]:
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    ns = engine.connector.scheduler.namespace
    h = chunk_hashes(ns, tokens, chunk + 1)[chunk]
    return [object_key(ns, h, 0, g) for g in range(len(engine.worker.worker.groups))]


def damage(url: str, keys: list[str], how: str) -> None:
    from storage import open_store

    with open_store(url) as s:
        for key in keys:
            if how == "delete":
                s.delete(key)
            else:
                blob = bytearray(s.get(key))
                blob[len(blob) // 2] ^= 0x40
                s.put(key, bytes(blob))


def damage_when_loaded(url: str, tokens: list[int], chunk: int, how: str = "corrupt") -> dict[str, Any]:
    """A hook: the first time a step plans a load, damage ``chunk``'s objects (after lookup, before fetch)."""

    def hook(engine: Engine, out: Any) -> None:
        if state["done"] or not out.kv_connector_metadata.loads:
            return
        damage(url, object_keys(engine, tokens, chunk), how)
        state["done"], state["step"] = True, len(engine.steps)

    state: dict[str, Any] = {"done": False, "hook": hook}
    return state


# ---- loads of a stored prefix ---------------------------------------------------------------
@pytest.mark.parametrize("block,chunk", [(16, 32), (32, 64), (16, 64)])
def test_stored_prefix_loads_at_block_and_chunk_sizes(tmp_path, store, block, chunk) -> None:
    p = prompt(300)
    stored(tmp_path, store, p, block_size=block, chunk_size=chunk)
    e = make(tmp_path, store, block_size=block, chunk_size=chunk)
    e.add("b", p[:250] + prompt(30, 1), max_tokens=3)
    e.run()
    assert loaded_tokens(e, "b") == 250 // block * block  # every block shared, as vLLM's own cache (block_hits)
    e.assert_empty()


def test_load_after_a_local_hit_starts_mid_chunk(tmp_path, store) -> None:
    """A local hit ending inside a chunk (2 blocks of a 4-block chunk): the load writes only the rest."""
    p = prompt(300)
    stored(tmp_path, store, p, block_size=16, chunk_size=64)
    e = make(tmp_path, store, block_size=16, chunk_size=64)
    e.add("short", p[:40], max_tokens=1)  # computes 40 tokens: 2 full blocks go to the local cache
    e.run()
    e.add("long", p[:290], max_tokens=2)
    e.run()
    (spec,) = loads_of(e, ["long"])
    assert spec.chunks[0].first_token == 32 and loaded_tokens(e, "long") == (290 - 1) // 16 * 16 - 32
    e.assert_empty()


@pytest.mark.parametrize("n_chunks,extra", [(0, 20), (1, 0), (3, 0)])
def test_prompt_sizes_save_every_full_chunk(tmp_path, store, n_chunks, extra) -> None:
    """A prompt of exactly N chunks saves N (the last token rule is for loads only); a shorter one its tail."""
    p = prompt(32 * n_chunks + extra)
    e = make(tmp_path, store)
    e.add("a", p, max_tokens=1)
    e.run()
    e.flush()
    assert e.stats().get("saved_chunks", 0) == n_chunks + (extra > 0)
    e.assert_empty()
    f = make(tmp_path, store)
    f.add("same", p, max_tokens=1)  # the same prompt: its last token is computed, so one chunk less
    f.add("longer", p + prompt(10, 1), max_tokens=1)
    f.run()
    assert loaded_tokens(f, "same") == (len(p) - 1) // 16 * 16  # every block but its last token's (block_hits)
    assert first_computed(f, "longer") >= 32 * n_chunks  # loaded, or a local hit on what "same" loaded
    f.assert_empty()


@pytest.mark.parametrize("n_chunks", [1, 3])
def test_a_replay_does_not_save_again_the_stored_chunk_its_last_token_is_in(tmp_path, store, n_chunks) -> None:
    """A prompt of exactly N chunks, replayed by a fresh engine, loads all but its last token's blocks and computes
    that chunk's last block. It used to save the whole chunk again: an encode and a put for nothing, and the first
    writer's object replaced by KV computed in another schedule of steps, whose bf16 bits can differ in the last
    place (a later engine's greedy tokens then depended on which of them wrote last; seen on an AMX Xeon)."""
    p = prompt(32 * n_chunks)
    e = make(tmp_path, store)
    e.add("a", p, max_tokens=1)
    e.run()
    e.flush()
    assert e.stats()["saved_chunks"] == n_chunks
    e.assert_empty()
    f = make(tmp_path, store)
    f.add("same", p, max_tokens=1)
    f.run()
    f.flush()
    assert f.stats().get("saved_chunks", 0) == 0, "the store holds every chunk of it"
    assert f.scheduler_stats()["saves_already_stored"] == 1
    assert loaded_tokens(f, "same") == 32 * n_chunks - 16
    f.assert_empty()


def first_computed(e: Engine, req_id: str) -> int:
    """Tokens ``req_id`` had (local hit + load) when it was first scheduled to compute."""
    return next(s.computed_before[req_id] for s in e.steps if req_id in s.computed_before)


# ---- failed loads ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["corrupt", "delete"])
@SCHEDULING
def test_sync_failed_load_is_recomputed_replaced_and_never_a_local_hit(tmp_path, store, how, pipelined) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    hook = damage_when_loaded(store, p, chunk=2, how=how)
    e = make(tmp_path, store, pipelined=pipelined, hooks={"before_forward": hook["hook"]})
    longer = p[:290] + prompt(40, 3)  # chunk 9 is computed in the failing step, over the missing KV
    e.add("r", longer, max_tokens=2)
    e.run()
    assert hook["done"]
    failed_step = e.steps[hook["step"]]
    assert failed_step.invalid_blocks, "the damaged chunk was not reported"
    assert e.scheduler_stats()["blocks_evicted_after_load_failure"] > 0
    assert e.stats()["saves_skipped_after_load_failure"] >= 1
    e.flush()
    # The recompute saved chunks 2 and 9 again: a fresh engine loads all ten, bit-exactly.
    assert reload(make(tmp_path, store, pipelined=pipelined), longer) == 320
    e.assert_empty()


def test_saves_planned_before_a_failure_was_known_are_dropped(tmp_path, store) -> None:
    """Async scheduling: step N+1 is planned before step N's failed load is reported; its saves rest on bad KV."""
    p = prompt(300)
    stored(tmp_path, store, p)
    hook = damage_when_loaded(store, p, chunk=2)
    e = make(tmp_path, store, pipelined=True, hooks={"before_forward": hook["hook"]})
    long = p[:290] + prompt(400, 4)  # a chunked prefill: 256 tokens in the failing step, the rest in the next
    e.add("r", long, max_tokens=2)
    e.run()
    next_step = e.steps[hook["step"] + 1]
    failed_load = e.steps[hook["step"]].loads[0].load_id
    assert next_step.saves and all(spec.unsettled_loads == [failed_load] for spec in next_step.saves)
    assert e.stats()["saves_skipped_after_load_failure"] >= len(next_step.saves)
    e.flush()
    assert reload(make(tmp_path, store), long) == (len(long) - 1) // 16 * 16  # every stored block of it is right
    e.assert_empty()


@SCHEDULING
def test_abort_before_recompute_leaves_no_local_hit_on_failed_blocks(tmp_path, store, pipelined) -> None:
    """The issue's case: a failed sync load, the request aborted before its recompute, the same prefix again."""
    abort_before_recompute(tmp_path, store, pipelined, check_cache=True)


def abort_before_recompute(tmp_path: Path, store: str, pipelined: bool, check_cache: bool) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    hook = damage_when_loaded(store, p, chunk=1)
    e = make(tmp_path, store, pipelined=pipelined, hooks={"before_forward": hook["hook"]})
    e.add("r", p[:290], max_tokens=2)
    e.admit()  # the load of chunks 0..8 fails at chunk 1; vLLM rewinds r to 32 tokens
    assert hook["done"] and e.steps[-1].invalid_blocks
    failed = set(e.steps[-1].loads[0].chunks[1].block_ids)
    e.deliver()  # (async scheduling) the scheduler sees that step's output
    e.abort("r")  # a client disconnect before the recompute step
    if check_cache:
        assert not failed & e.cached_block_ids(), "blocks whose load failed are still in the prefix cache"
    e.add("next", p[:290], max_tokens=2)
    e.run()  # its context check would catch KV that was never written
    assert first_computed(e, "next") <= 32 + loaded_tokens(e, "next")
    e.assert_empty()


@pytest.mark.parametrize("how", ["corrupt", "delete"])
@SCHEDULING
def test_async_failed_load_does_not_loop(tmp_path, store, how, pipelined) -> None:
    """The first chunk vanishes between lookup and fetch: one failed load, then the request computes."""
    p = prompt(300)
    stored(tmp_path, store, p)
    hook = damage_when_loaded(store, p, chunk=0, how=how)
    e = make(tmp_path, store, pipelined=pipelined, load_mode="async", hooks={"before_forward": hook["hook"]})
    e.add("r", p[:290], max_tokens=2)
    e.run(max_steps=40)
    assert hook["done"] and len(loads_of(e, ["r"])) == 1, "the failing load was planned again"
    e.flush()
    f = make(tmp_path, store, pipelined=pipelined, load_mode="async")
    assert reload(f, p[:290]) == 288  # r's recompute replaced the damaged object
    e.assert_empty()


def test_async_failed_later_chunk_keeps_the_good_prefix(tmp_path, store) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    hook = damage_when_loaded(store, p, chunk=4)
    e = make(tmp_path, store, load_mode="async", hooks={"before_forward": hook["hook"]})
    e.add("r", p[:290], max_tokens=2)
    e.run(max_steps=40)
    assert len(loads_of(e, ["r"])) == 1
    first_compute = next(s for s in e.steps if e.steps.index(s) > hook["step"] and "r" in s.scheduled)
    assert first_compute.computed_before["r"] == 4 * 32  # the chunks before the failure are kept
    e.assert_empty()


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_fail_policy_fails_the_request_cleanly(tmp_path, store, load_mode) -> None:
    from vllm.v1.engine import FinishReason

    p = prompt(300)
    stored(tmp_path, store, p)
    hook = damage_when_loaded(store, p, chunk=2)
    e = make(tmp_path, store, load_mode=load_mode, on_load_failure="fail", hooks={"before_forward": hook["hook"]})
    assert e.vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    e.add("r", p[:290], max_tokens=2)
    e.run(max_steps=40)
    assert e.finished["r"] == FinishReason.ERROR
    e.add("next", p[:290], max_tokens=1)  # vLLM evicted the failed blocks; the connector skips the failed chunk
    e.run()
    e.assert_empty()


# ---- aborts ---------------------------------------------------------------------------------
def test_abort_before_any_step(tmp_path, store) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store)
    e.add("r", p, max_tokens=2)
    e.abort("r")
    e.run()
    assert not loads_of(e)
    e.assert_empty()


def test_abort_during_an_async_load_frees_blocks_only_after_it_stops(tmp_path) -> None:
    slow = f"link+file://{tmp_path / 'store'}?gbps=0.02&rtt_ms=1"
    p = prompt(300)
    stored(tmp_path, f"file://{tmp_path / 'store'}", p, **SAME_OBJECTS)
    e = make(tmp_path, slow, load_mode="async", fetch_threads=1, **SAME_OBJECTS)
    e.add("r", p[:290], max_tokens=2)
    e.admit()  # lookup, allocation, load started
    assert loads_of(e, ["r"]) and e.scheduler.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS"
    held = e.block_table("r")
    e.abort("r")
    assert "r" in e.scheduler.requests, "vLLM must hold the blocks of a load in flight"
    assert set(held) <= {b.block_id for b in e.scheduler.kv_cache_manager.block_pool.blocks if b.ref_cnt > 0}
    e.run(max_steps=20)
    assert e.stats().get("loads_abandoned") == 1
    e.add("next", p[:290], max_tokens=1)  # nothing of the abandoned load is trusted as a local hit
    e.run()
    e.assert_empty()


def test_an_idle_step_waits_for_its_async_load_instead_of_spinning(tmp_path, store, monkeypatch) -> None:
    """While a request only waits for its remote KV, vLLM steps again at once with nothing scheduled.

    Those plans say so (``idle``), and in them the worker waits for the load
    it started, GIL released, rather than return to a loop that spins against
    the fetch threads (a 4k-token async load took 13-19 s that way on 2 cores).
    """
    from vllm_kvcodec.connector import worker_half

    monkeypatch.setattr(worker_half, "IDLE_POLL_S", 60.0)  # the load surely ends within it: no timing in the test
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store, load_mode="async")
    e.add("r", p[:290], max_tokens=3)
    first = e.admit()
    assert first.idle and loads_of(e, ["r"]) and first.finished_recving == {"r"}, "started and awaited in one step"
    e.run()
    assert loaded_tokens(e, "r") == 288
    assert [s.idle for s in e.steps] == [not s.scheduled for s in e.steps]
    assert e.steps[e.steps.index(first) + 1].scheduled == {"r": 2}, "the next step computes the suffix"
    e.assert_empty()


def test_abort_after_a_load(tmp_path, store) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store)
    e.add("r", p[:290], max_tokens=20)
    e.admit()
    assert loaded_tokens(e, "r") == 288
    e.step()
    e.abort("r")
    e.add("next", p[:290], max_tokens=1)  # the loaded blocks are good local hits now
    e.run()
    assert loaded_tokens(e, "next") == 0
    e.assert_empty()


# ---- preemption -----------------------------------------------------------------------------
@pytest.mark.parametrize("load_mode", ["sync", "async"])
@SCHEDULING
def test_preempted_loaded_request_resumes_with_right_kv(tmp_path, store, load_mode, pipelined) -> None:
    """A request that loaded its prefix is preempted for blocks, resumes, and looks the store up again."""
    p = prompt(300)
    stored(tmp_path, store, p)
    # 21 usable blocks of 16: both prompts fit, both decodes do not; vLLM preempts the later one.
    e = make(tmp_path, store, pipelined=pipelined, load_mode=load_mode, num_blocks=22)
    e.add("first", prompt(150, 7), max_tokens=40)
    e.run(until=lambda eng: eng.requests["first"].num_output_tokens > 0)
    e.add("loaded", p[:160], max_tokens=40)
    e.run(max_steps=400)
    assert e.requests["loaded"].num_preemptions == 1 and len(e.finished) == 2
    assert len(loads_of(e, ["loaded"])) == 2, "the resumed request should load what its local hit lacks"
    assert e.scheduler_stats()["lookups"] == 3
    e.assert_empty()


# ---- many requests, one prefix ----------------------------------------------------------------
@pytest.mark.parametrize("load_mode", ["sync", "async"])
@SCHEDULING
def test_burst_sharing_a_prefix_loads_it_once(tmp_path, store, load_mode, pipelined) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store, pipelined=pipelined, load_mode=load_mode, max_batched=1024)
    for i in range(8):
        e.add(f"r{i}", p[:256] + prompt(20, 100 + i), max_tokens=2)
    e.run()
    chunk0 = loads_of(e)[0].chunks[0].chunk_hash
    assert sum(1 for spec in loads_of(e) for c in spec.chunks if c.chunk_hash == chunk0) == 1
    assert e.scheduler_stats().get("lookups_waiting_for_inflight_load", 0) > 0
    e.assert_empty()


# ---- multi-turn -----------------------------------------------------------------------------
@SCHEDULING
def test_second_turn_loads_every_chunk_the_first_turn_computed(tmp_path, store, pipelined) -> None:
    """Turn 2 extends turn 1's prompt and answer: every full chunk of both is stored and loaded."""
    turn1 = prompt(100)
    e = make(tmp_path, store, pipelined=pipelined)
    req = e.add("turn1", turn1, max_tokens=40)
    e.run()
    e.flush()
    answer = list(req.output_token_ids)
    computed = len(turn1) + len(answer) - 1  # the last sampled token never went through the model
    assert e.stats()["saved_chunks"] == computed // 32
    e.assert_empty()
    f = make(tmp_path, store, pipelined=pipelined)
    f.add("turn2", turn1 + answer + prompt(30, 5), max_tokens=2)
    f.run()
    assert loaded_tokens(f, "turn2") == computed // 32 * 32
    f.assert_empty()


# ---- saves left to another request ----------------------------------------------------------
def test_a_save_left_to_a_request_whose_save_failed_is_made_by_the_one_still_holding_it(tmp_path) -> None:
    """Two requests share a new prefix; the first claims its chunks, finishes, and its puts fail after it is
    gone. The second skipped them for its claim: it saves them once the failure is reported."""
    from storage.testing.faults import find_fault_injector

    url = f"file://{tmp_path / 'store'}"
    state = {"phase": 0}

    def outage_for_the_first_saves(engine: Engine, out: Any) -> None:
        faults = find_fault_injector(engine.worker.worker.store)
        if state["phase"] == 0 and out.kv_connector_metadata.saves:
            faults.down()  # after the plans, before the worker gathers and puts
            state["phase"] = 1
        elif state["phase"] == 1:
            assert engine.worker.flush(30)  # those puts have failed by now
            faults.up()
            state["phase"] = 2

    e = make(tmp_path, f"faults+{url}", store_retry_s=0, hooks={"before_forward": outage_for_the_first_saves},
             **SAME_OBJECTS)
    shared = prompt(64, 11)
    e.add("first", shared + prompt(6, 12), max_tokens=1)
    e.add("second", shared + prompt(6, 13), max_tokens=12)
    e.run()
    e.flush()
    assert state["phase"] == 2 and e.stats()["save_failures"] >= 2
    assert e.scheduler_stats()["saves_deduplicated"] >= 2
    e.assert_empty()
    assert reload(make(tmp_path, url, **SAME_OBJECTS), shared + prompt(6, 14)) == 64


# ---- saves past the memory cap --------------------------------------------------------------
CHUNK_BYTES = 256 * 512  # a 256-token chunk of the harness's two bf16 layers (2 KV x 2 heads x 32 dims)


@SCHEDULING
def test_saves_dropped_for_room_are_planned_again_once_the_queue_drains(tmp_path, pipelined) -> None:
    """16 chunks complete in one step under a cap of 8: 8 are dropped before gathering, each waits for a report
    with room (a put takes 42 ms, many steps), then lands. Retried every step, they spent their attempts first;
    a drop for want of room spends none at all: with async scheduling a report's room is a step stale, and saves
    planned from it that found the queue full again used to spend all three and be given up."""
    from storage import open_store

    url = f"file://{tmp_path / 'store'}"
    e = make(tmp_path, f"link+{url}?gbps=0.025", pipelined=pipelined, chunk_size=256, num_blocks=600,
             max_batched=8192, save_threads=1, max_pending_save_bytes=8 * CHUNK_BYTES, **SAME_OBJECTS)
    p = prompt(16 * 256 + 10)
    keys = [k for c in range(16) for k in object_keys(e, p, c)]
    e.add("r", p, max_tokens=3000)  # decodes on while the queue drains
    with open_store(url) as s:
        e.run(max_steps=3000, until=lambda e: all(s.exists_many(keys)))
    assert max(e.connector.scheduler.requests["r"].save_attempts.values()) == 1  # each landed on its one attempt
    e.abort("r")
    e.run()
    assert e.stats()["saves_dropped"] >= 8
    e.assert_empty()
    assert reload(make(tmp_path, url, chunk_size=256, num_blocks=600, max_batched=8192, **SAME_OBJECTS), p) == 16 * 256


def test_a_cap_below_one_chunk_is_refused_at_start_up(tmp_path, store) -> None:
    from vllm_kvcodec.errors import ConfigError

    with pytest.raises(ConfigError, match="below one chunk"):
        make(tmp_path, store, chunk_size=8192, max_pending_save_bytes=1 << 20)  # 4 MiB chunks


# ---- contract -------------------------------------------------------------------------------
def test_contract_details(tmp_path, store) -> None:
    from vllm_kvcodec.connector import KVCodecConnector
    from vllm_kvcodec.errors import ConfigError

    e = make(tmp_path, store)
    assert e.connector.requires_kv_delivery is False and e.worker.requires_kv_delivery is False
    assert KVCodecConnector.supports_sleep_mode(e.vllm_config.kv_transfer_config) is False
    assert e.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"  # vLLM's default is fail
    kept = make(tmp_path, store, policy="recompute")
    assert kept.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    with pytest.raises(ConfigError, match="disagree"):
        make(tmp_path, store, policy="recompute", on_load_failure="fail")


def test_auto_reads_a_probe_at_start_up_and_leaves_nothing(tmp_path, store) -> None:
    """codec auto learns the store's read bandwidth before the first save: puts alone misread it."""
    from storage import open_store

    e = make(tmp_path, store, codec="auto")
    assert e.worker.worker.chooser.link.measured
    with open_store(store) as s:
        assert list(s.keys()) == []
    e.shutdown()


def test_a_load_only_instance_writes_no_probe(tmp_path, store) -> None:
    """auto chooses the codec of saves: an instance that never saves has no use for the probe's put (on a shared
    store near its cap that put would evict others' chunks)."""
    e = make(tmp_path, store, codec="auto", save=False)
    assert not e.worker.worker.chooser.link.measured
    e.shutdown()


def test_the_harness_catches_a_poisoned_local_hit(tmp_path, store, monkeypatch) -> None:
    """Without the eviction, the abort-before-recompute case reads KV that was never written."""
    from vllm_kvcodec.connector.load_planner import LoadPlanner

    monkeypatch.setattr(LoadPlanner, "_evict_from", lambda self, block_ids, first_token: None)
    with pytest.raises(Violation, match="wrong KV"):
        abort_before_recompute(tmp_path, store, False, check_cache=False)
