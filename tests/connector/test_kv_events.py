"""The store's KV cache events, as vLLM's real Scheduler publishes them: what a router would receive.

Runs on :mod:`tests.support.scheduler_harness` (real Scheduler, real worker
half, real file store), with vLLM's KV events turned on as
``--kv-events-config`` does (``kv_events_config`` in the engine's config), and
the scheduler's publisher replaced by a recorder: every batch vLLM would put
on the wire, its own GPU events and the connector's, is kept. The block hashes
are checked against a chain computed here with vLLM's hashing functions
(``hash_block_tokens``, independent of the connector) and against the GPU
``BlockStored`` events vLLM publishes for the same blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BLOCK, CHUNK = 16, 32
MEDIUM = "KVCODEC"


class Recorder:
    """Stands in for vLLM's ZMQ publisher: keeps every event the scheduler publishes."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass

    def of(self, kind: str, medium: str = MEDIUM) -> list[Any]:
        return [e for e in self.events if type(e).__name__ == kind and e.medium == medium]


def turn_on_vllm_kv_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from now on get ``kv_events_config`` as ``vllm serve --kv-events-config`` sets it.

    The harness builds its config and its ``Scheduler`` in one go; a Scheduler
    that sets the config's ``kv_events_config`` first is vLLM's own otherwise.
    """
    import vllm.v1.core.sched.scheduler as sched
    from vllm.config import KVEventsConfig

    class SchedulerWithKVEvents(sched.Scheduler):
        def __init__(self, vllm_config: Any, *args: Any, **kw: Any) -> None:
            vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            super().__init__(vllm_config, *args, **kw)

    monkeypatch.setattr(sched, "Scheduler", SchedulerWithKVEvents)


@pytest.fixture
def kv_events_on(monkeypatch: pytest.MonkeyPatch) -> None:
    turn_on_vllm_kv_events(monkeypatch)


def make(tmp_path: Path, store: str, **kw: Any) -> tuple[Engine, Recorder]:
    e = Engine(tmp_path, store, block_size=BLOCK, chunk_size=CHUNK, **kw)
    recorder = Recorder()
    e.scheduler.kv_event_publisher = recorder
    return e, recorder


def settle(e: Engine) -> None:
    """Wait for queued saves, then step once so their outcomes reach the scheduler (as the next step would)."""
    e.flush()
    e.step()


def vllm_chain(tokens: list[int], block_size: int = BLOCK) -> list[Any]:
    """vLLM's block hashes of ``tokens``' whole blocks, computed here with vLLM's own hashing, as events carry them."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    parent, chain = None, []
    for b in range(len(tokens) // block_size):
        parent = hash_block_tokens(fn, parent, tokens[b * block_size : (b + 1) * block_size], None)
        chain.append(maybe_convert_block_hash(parent))
    return chain


def check_stored(event: Any, tokens: list[int], first_block: int, blocks: int, locality: str = "LOCAL") -> None:
    chain = vllm_chain(tokens)
    assert event.block_hashes == chain[first_block : first_block + blocks]
    assert event.parent_block_hash == (chain[first_block - 1] if first_block else None)
    assert event.token_ids == tokens[first_block * BLOCK : (first_block + blocks) * BLOCK]
    assert event.block_size == BLOCK and event.group_idx == 0
    assert event.locality == locality  # LOCAL: a file store on this host's disk


def test_each_saved_chunk_is_announced_once_it_landed_in_vllm_block_hashes(tmp_path, store, kv_events_on) -> None:
    p = prompt(100)  # 3 full chunks of 2 blocks
    e, rec = make(tmp_path, store)
    request = e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    stored = rec.of("BlockStored")
    assert len(stored) == 3
    chain = vllm_chain(p)
    for c in range(3):
        (event,) = [ev for ev in stored if ev.block_hashes == chain[2 * c : 2 * c + 2]]
        check_stored(event, p, 2 * c, 2)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    announced = [h for ev in stored for h in ev.block_hashes]
    assert sorted(announced) == sorted(maybe_convert_block_hash(h) for h in request.block_hashes[:6])
    # vLLM's own events for the same blocks (its GPU prefix cache) carry the same hashes and chain.
    gpu = {h: ev for ev in rec.of("BlockStored", "GPU") for h in ev.block_hashes}
    assert set(announced) <= set(gpu)
    assert e.connector.stats()["kv_events_stored_blocks"] == 6
    e.assert_empty()
    e.shutdown()


def test_nothing_is_announced_before_the_save_landed(tmp_path, store, kv_events_on) -> None:
    """The steps that plan the saves publish no store event: the put has not happened yet."""
    p = prompt(64)
    e, rec = make(tmp_path, store, block_hits=False)  # two chunks, no tail
    e.add("a", p, max_tokens=1)
    record = e.step()  # plans both chunks' saves; their outcomes come in a later report
    assert len(record.saves) == 2
    landed_in_this_step = [s for s in (record.report.saves if record.report else []) if s.landed]
    assert len(rec.of("BlockStored")) == len(landed_in_this_step)
    e.run()
    settle(e)
    assert len(rec.of("BlockStored")) == 2
    e.assert_empty()
    e.shutdown()


def test_a_prompt_tail_is_announced_as_its_whole_blocks(tmp_path, store, kv_events_on) -> None:
    p = prompt(120)  # 3 chunks, then a tail of one whole block (96..111) before the block of the last token
    e, rec = make(tmp_path, store, prompt_tails=True)
    e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    by_first = {ev.token_ids[0]: ev for ev in rec.of("BlockStored")}
    assert len(by_first) == 4
    check_stored(by_first[p[96]], p, 6, 1)
    e.assert_empty()
    e.shutdown()


def test_a_save_that_failed_is_not_announced_and_its_retry_is(tmp_path, kv_events_on) -> None:
    """The worker's store refuses the first puts (the scheduler's answers): only the retries are announced."""
    store = f"faults+file://{tmp_path / 'store'}?seed=1"
    e, rec = make(tmp_path, store, store_retry_s=0)
    worker_store = e.worker.worker.store.inner
    worker_store.down()
    e.add("a", prompt(64), max_tokens=6)  # still running when the failures come back: it plans the saves again
    while not any(step.saves for step in e.steps):
        e.step()
    e.flush()  # both puts failed
    worker_store.up()
    e.run()
    settle(e)
    stats = e.stats()
    assert stats["save_failures"] >= 2 and stats["saved_chunks"] == 2
    stored = rec.of("BlockStored")
    assert len(stored) == 2
    p = e.requests["a"].all_token_ids
    for event in stored:
        first = event.token_ids[0]
        check_stored(event, list(p), 0 if first == p[0] else 2, 2, "REMOTE")  # a wrapper store: not read in memory
    e.assert_empty()
    e.shutdown()


def damage_when_loaded(url: str, e: Engine, tokens: list[int], chunk: int) -> dict[str, Any]:
    """A hook: when a step first plans a load, flip a bit in the middle of ``chunk``'s objects (after the lookup)."""
    from storage import open_store
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    def hook(engine: Engine, out: Any) -> None:
        if state["done"] or not out.kv_connector_metadata.loads:
            return
        ns = engine.connector.scheduler.namespace
        h = chunk_hashes(ns, tokens, chunk + 1)[chunk]
        with open_store(url) as s:
            for g in range(len(engine.worker.worker.groups)):
                blob = bytearray(s.get(object_key(ns, h, 0, g)))
                blob[len(blob) // 2] ^= 0x40
                s.put(object_key(ns, h, 0, g), bytes(blob))
        state["done"] = True

    state: dict[str, Any] = {"done": False}
    e.hooks["before_forward"] = hook
    return state


def test_a_damaged_object_found_by_a_load_is_announced_removed_then_stored_again(tmp_path, store, kv_events_on) -> None:
    p = prompt(100)
    producer, _ = make(tmp_path, store)
    producer.add("producer", p, max_tokens=1)
    producer.run()
    producer.flush()
    producer.shutdown()

    e, rec = make(tmp_path, store)
    state = damage_when_loaded(store, e, p, chunk=1)
    e.add("b", p, max_tokens=2)
    e.run()
    settle(e)
    assert state["done"]
    failed = {h for step in e.steps if step.report for o in step.report.loads.values() for h in o.failed}
    assert failed, "the damaged chunk's load did not fail"
    removed = rec.of("BlockRemoved")
    chain = vllm_chain(p)
    removed_hashes = [h for ev in removed for h in ev.block_hashes]
    assert chain[2] in removed_hashes and chain[3] in removed_hashes  # chunk 1's two blocks
    assert len(removed_hashes) == 2 * len(failed)  # each failed chunk's blocks, once
    assert all(ev.group_idx == 0 and ev.locality == "LOCAL" and ev.ownership == "kvcodec" for ev in removed)
    # The request recomputed the chunk and saved it again: announced as stored anew.
    restored = [ev for ev in rec.of("BlockStored") if ev.block_hashes == chain[2:4]]
    assert len(restored) == 1
    check_stored(restored[0], p, 2, 2)
    e.assert_empty()
    e.shutdown()


def test_no_store_events_without_vllm_kv_events_or_with_kv_events_off(tmp_path, store, monkeypatch) -> None:
    p = prompt(64)
    e, rec = make(tmp_path, store)  # vLLM's KV events are off: nothing of the store is published
    e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    assert e.stats()["saved_chunks"] == 2 and not rec.events
    e.shutdown()

    turn_on_vllm_kv_events(monkeypatch)
    e, rec = make(tmp_path, f"file://{tmp_path / 'other'}", kv_events=False)  # vLLM's on, the connector's off
    e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    assert rec.of("BlockStored", "GPU") and not rec.of("BlockStored") and not rec.of("BlockRemoved")
    e.shutdown()


def test_the_medium_is_configurable(tmp_path, store, kv_events_on) -> None:
    e, rec = make(tmp_path, store, kv_events_medium="STORAGE")
    e.add("a", prompt(40), max_tokens=1)
    e.run()
    settle(e)
    (event,) = rec.of("BlockStored", "STORAGE")
    check_stored(event, prompt(40), 0, 2)
    e.shutdown()


def test_store_events_carry_an_ownership_gpu_events_none(tmp_path, store, kv_events_on) -> None:
    """vLLM's field for the secondary tier an event comes from: what makes vllm-router count the blocks as its
    External tier (tests/tools/test_router_kv_events.py). BlockRemoved carries it too (the damaged-object test)."""
    p = prompt(40)
    e, rec = make(tmp_path, store)
    e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    (event,) = rec.of("BlockStored")
    assert event.ownership == "kvcodec"
    assert all(ev.ownership is None for ev in rec.of("BlockStored", "GPU"))
    e.shutdown()

    e, rec = make(tmp_path, f"file://{tmp_path / 'other'}", kv_events_ownership=None)  # configurable, or none
    e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    (event,) = rec.of("BlockStored")
    assert event.ownership is None
    e.shutdown()


def test_async_scheduling_announces_the_same_chunks(tmp_path, store, monkeypatch) -> None:
    """vLLM's async scheduling (outputs one step late): the same events, nothing lost or doubled."""
    turn_on_vllm_kv_events(monkeypatch)
    import vllm.v1.core.sched.async_scheduler as async_sched
    import vllm.v1.core.sched.scheduler as sched

    class AsyncSchedulerWithKVEvents(async_sched.AsyncScheduler, sched.Scheduler):  # the patched Scheduler's __init__
        pass

    monkeypatch.setattr(async_sched, "AsyncScheduler", AsyncSchedulerWithKVEvents)
    p = prompt(100)
    e, rec = make(tmp_path, store, async_scheduling=True)
    e.add("a", p, max_tokens=3)
    e.run()
    settle(e)
    e.deliver()
    chain = vllm_chain(p)
    assert sorted(h for ev in rec.of("BlockStored") for h in ev.block_hashes) == sorted(chain[:6])
    e.assert_empty()
    e.shutdown()


def test_each_kv_cache_group_gets_its_own_event(tmp_path, store, kv_events_on) -> None:
    """A hybrid model (a full-attention layer and a sliding-window one): one BlockStored per group and chunk."""
    p = prompt(70)
    e, rec = make(tmp_path, store, windows=[None, 64])
    e.add("a", p, max_tokens=1)
    e.run()
    settle(e)
    stored = rec.of("BlockStored")
    assert len(stored) == 4
    chain = vllm_chain(p)
    for group in (0, 1):
        for c in (0, 1):
            (event,) = [ev for ev in stored if ev.group_idx == group and ev.block_hashes == chain[2 * c : 2 * c + 2]]
            assert event.token_ids == p[32 * c : 32 * c + 32] and event.block_size == BLOCK
    e.assert_empty()
    e.shutdown()


def test_a_late_failure_of_an_aborted_request_is_announced_even_when_its_id_came_back(tmp_path, store,
                                                                                       kv_events_on) -> None:
    """r's load fails at chunk 1, its report late; r is aborted and a new "r" (another prompt) loads its own chunks.
    The late report must name the first r's failed blocks (load events are kept per load, not per request id)."""
    from tests.connector.test_scheduler_lifecycle import damage_when_loaded as damage_on_load
    from tests.connector.test_scheduler_lifecycle import stored

    p, q = prompt(100), prompt(100, 5)
    for tokens in (p, q):
        stored(tmp_path, store, tokens, block_size=BLOCK, chunk_size=CHUNK)
    damage = damage_on_load(store, p, chunk=1, how="delete")
    late: dict[str, bool] = {}

    def hook(engine: Engine, out: Any) -> None:
        damage["hook"](engine, out)
        new_r_loads = any(s.req_id == "r" for s in out.kv_connector_metadata.loads)
        if new_r_loads and damage["done"] and not late and engine.requests["r"].prompt_token_ids == q:
            engine.deliver_withheld()
            late["delivered"] = True

    e, rec = make(tmp_path, store, hooks={"before_forward": hook})
    e.withhold_load_reports = True
    e.add("r", p, max_tokens=2)
    e.admit()
    assert damage["done"]
    e.abort("r")
    e.withhold_load_reports = False
    e.add("r", q, max_tokens=2)
    e.run()
    settle(e)
    assert late, "the new r's load was never planned"
    removed = [h for ev in rec.of("BlockRemoved") for h in ev.block_hashes]
    assert vllm_chain(p)[2:4] == [h for h in removed if h in vllm_chain(p)[2:4]], removed  # chunk 1 of p
    assert not set(removed) & set(vllm_chain(q)), "the new r's blocks were announced removed"
    e.assert_empty()
