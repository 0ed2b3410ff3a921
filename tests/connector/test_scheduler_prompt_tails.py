"""Prompt tails (``block_hits``, formerly ``prompt_tails``) through vLLM's real Scheduler, step by step.

A tail is a prompt's KV past its last full chunk, in whole blocks up to the
block holding its last token. The harness checks every plan against the block
tables (a tail's slots, its key as the tail of this prompt, never the last
token) and that every request reads the right KV, so a tail loaded into the
wrong blocks, or one saved before its KV was complete, fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, loaded_tokens, loads_of, prompt

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]


BLOCK, CHUNK = 16, 64
SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])


def make(tmp_path: Path, store: str, pipelined: bool = False, **kw: Any) -> Engine:
    kw = {"prompt_tails": True, "block_size": BLOCK, "chunk_size": CHUNK, **kw}
    return Engine(tmp_path, store, async_scheduling=pipelined, **kw)


def run_one(engine: Engine, req_id: str, tokens: list[int], max_tokens: int = 1) -> Any:
    req = engine.add(req_id, tokens, max_tokens=max_tokens)
    engine.run()
    engine.flush()
    return req


def replayable(n: int) -> int:
    """What a replay of an ``n``-token prompt can take from any cache: every block but the last token's."""
    return (n - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("n", [300, 256, 250, 40, 17])
@pytest.mark.parametrize("load_mode", ["sync", "async"])
@SCHEDULING
def test_a_replayed_prompt_loads_every_block_but_the_last_tokens(tmp_path, store, n, load_mode, pipelined) -> None:
    """Full chunks alone would leave up to a chunk to compute (all of it for 256 = 4 chunks: the last token's)."""
    p = prompt(n)
    first = make(tmp_path, store, pipelined, load_mode=load_mode)
    run_one(first, "a", p)
    # a tail only where its chunk is not full in the prompt (256: chunk 3 is saved whole, with its block refs)
    assert first.scheduler_stats().get("tail_saves_planned", 0) == (1 if replayable(n) % CHUNK and n % CHUNK else 0)
    first.assert_empty()
    again = make(tmp_path, store, pipelined, load_mode=load_mode)
    run_one(again, "replay", p)
    assert loaded_tokens(again, "replay") == replayable(n)
    assert again.stats().get("load_failures", 0) == 0
    again.assert_empty()


@SCHEDULING
def test_the_next_turn_loads_the_last_turns_tail(tmp_path, store, pipelined) -> None:
    """Turn 2 = turn 1's prompt, its answer and more than a chunk of new text: turn 1's tail is found after the
    chunks they share, and its own tail is saved for turn 3."""
    turn1 = prompt(100)
    e = make(tmp_path, store, pipelined)
    req = run_one(e, "turn1", turn1, max_tokens=2)
    e.assert_empty()
    turn2 = turn1 + list(req.output_token_ids) + prompt(90, 5)  # 192 tokens: chunk 1 (64..128) was never full
    f = make(tmp_path, store, pipelined)
    run_one(f, "turn2", turn2)
    (spec,) = loads_of(f, ["turn2"])
    tail = spec.chunks[-1]
    assert tail.object_tokens == replayable(len(turn1)) - CHUNK  # turn 1's tail: 32 tokens after chunk 0
    assert loaded_tokens(f, "turn2") == replayable(len(turn1))
    assert f.scheduler_stats().get("tail_saves_planned", 0) == 0  # 192 tokens: chunk 2 is full, saved with its refs
    f.assert_empty()


def test_without_prompt_tails_nothing_changes(tmp_path, store) -> None:
    p = prompt(300)
    run_one(make(tmp_path, store, prompt_tails=False), "a", p)
    e = make(tmp_path, store)  # tails on, but none were saved: whole chunks only
    run_one(e, "replay", p)
    assert loaded_tokens(e, "replay") == 256
    assert e.scheduler_stats().get("tail_saves_planned", 0) == 1  # its own, for the next replay
    e.assert_empty()


def test_a_loaded_tail_is_not_saved_again_and_a_longer_prompt_keeps_its_own(tmp_path, store) -> None:
    p = prompt(300)
    run_one(make(tmp_path, store), "a", p)
    e = make(tmp_path, store, max_batched=1024)
    e.add("replay", p, max_tokens=1)
    e.add("longer", p + prompt(10, 1), max_tokens=1)  # same chunks, a longer tail of its own
    e.run()
    e.flush()
    assert loaded_tokens(e, "replay") + loaded_tokens(e, "longer") >= replayable(300)
    assert e.scheduler_stats().get("tail_saves_planned", 0) == 1  # "longer"'s; "replay" loaded its own
    e.assert_empty()


@pytest.mark.parametrize("how", ["corrupt", "delete"])
@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_a_failed_tail_is_recomputed_and_saved_anew(tmp_path, store, how, load_mode) -> None:
    from tests.connector.test_scheduler_lifecycle import damage

    p = prompt(300)
    run_one(make(tmp_path, store), "a", p)
    damaged: dict[str, bool] = {}

    def hook(engine: Engine, out: Any) -> None:
        loads = out.kv_connector_metadata.loads
        if damaged or not loads:
            return
        tail = loads[0].chunks[-1]
        assert tail.object_tokens, "the replay should load a tail"
        damage(store, _keys(engine, tail.chunk_hash), how)
        damaged["yes"] = True

    e = make(tmp_path, store, load_mode=load_mode, hooks={"before_forward": hook})
    run_one(e, "replay", p)
    assert damaged
    assert e.scheduler_stats()["failed_load_chunks"] == 1
    assert e.scheduler_stats()["tail_saves_planned"] == 1  # recomputed, then saved over the damaged object
    e.assert_empty()
    fresh = make(tmp_path, store)
    run_one(fresh, "again", p)
    assert loaded_tokens(fresh, "again") == replayable(300)
    assert fresh.stats().get("load_failures", 0) == 0
    fresh.assert_empty()


def _keys(engine: Engine, chunk_hash: str) -> list[str]:
    from vllm_kvcodec.keys.chain import object_key

    ns = engine.connector.scheduler.namespace
    return [object_key(ns, chunk_hash, 0, g) for g in range(len(engine.worker.worker.groups))]


def test_a_window_model_loads_its_tail_into_the_window(tmp_path, store) -> None:
    """A sliding-window group (loads async, one group per kind): the tail lands in both groups' blocks."""
    p = prompt(300)
    run_one(make(tmp_path, store, windows=[None, 128]), "a", p)
    e = make(tmp_path, store, windows=[None, 128])
    run_one(e, "replay", p)
    assert loaded_tokens(e, "replay") == replayable(300)
    e.assert_empty()


@pytest.mark.parametrize("load_mode", ["sync", "async"])
@SCHEDULING
def test_a_burst_of_replays_loads_the_tail_once(tmp_path, store, load_mode, pipelined) -> None:
    """Requests that would take a tail in flight as a local hit (or load it again) wait for its outcome: their full
    chunks are local hits here, so only the tail's position says it is in flight."""
    p = prompt(300)
    run_one(make(tmp_path, store), "a", p)
    e = make(tmp_path, store, pipelined, load_mode=load_mode, max_batched=1024)
    run_one(e, "warm", p[:260])  # chunks 0-3 into vLLM's local cache, no tail of its own (256 = 4 chunks)
    for i in range(4):
        e.add(f"r{i}", p, max_tokens=2)
    e.run()
    tails = [c for spec in loads_of(e) for c in spec.chunks if c.object_tokens]
    assert len(tails) == 1
    assert e.scheduler_stats().get("lookups_waiting_for_inflight_load", 0) > 0
    e.assert_empty()
