"""Where a hit ends (``block_hits``, the default), through vLLM's real Scheduler, step by step.

A prompt that shares part of a stored one must load exactly what vLLM's own
prefix cache would give it: every whole block of the shared part (never the
last token's), wherever the shared part ends (on a chunk boundary, on a
block boundary inside a chunk, inside a block, inside the stored prompt's
tail). The harness writes true KV, checks every plan against the block
tables, and fails any request that reads KV never written, so a ref naming
the wrong object, or a load of more blocks than were shared, fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, loaded_tokens, prompt

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]

BLOCK, CHUNK = 16, 64
SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])


def make(tmp_path: Path, store: str, pipelined: bool = False, **kw: Any) -> Engine:
    return Engine(tmp_path, store, async_scheduling=pipelined, **{"block_size": BLOCK, "chunk_size": CHUNK, **kw})


def run_one(engine: Engine, req_id: str, tokens: list[int], max_tokens: int = 1) -> Any:
    req = engine.add(req_id, tokens, max_tokens=max_tokens)
    engine.run()
    engine.flush()
    return req


def local_hit(shared: int, n: int) -> int:
    """What vLLM's own prefix cache gives an ``n``-token prompt sharing ``shared`` tokens with a computed one."""
    return min(shared // BLOCK, (n - 1) // BLOCK) * BLOCK


def sharing(stored: list[int], shared: int, n: int) -> list[int]:
    """An ``n``-token prompt whose first ``shared`` tokens are ``stored``'s and whose next token differs."""
    rest = [t for t in prompt(n + 8, seed=shared + 7) if t != stored[shared]][: n - shared] if shared < len(stored) else prompt(n - shared, 9)
    return stored[:shared] + rest


# shared prefix ends: on a chunk boundary, on a block inside a chunk, inside a block, in the first chunk's first
# block, inside the stored prompt's tail (300 tokens: tail 256..288), and the whole prompt (a replay)
POSITIONS = [128, 160, 170, 7, 40, 270, 300]


@pytest.mark.parametrize("shared", POSITIONS)
@pytest.mark.parametrize("load_mode", ["sync", "async"])
@SCHEDULING
def test_a_hit_ends_where_the_local_prefix_cache_would(tmp_path, store, shared, load_mode, pipelined) -> None:
    stored = prompt(300)
    first = make(tmp_path, store, pipelined, load_mode=load_mode)
    run_one(first, "a", stored)
    first.assert_empty()
    other = sharing(stored, shared, 320) if shared < 300 else stored
    again = make(tmp_path, store, pipelined, load_mode=load_mode)
    run_one(again, "b", other)
    assert loaded_tokens(again, "b") == local_hit(shared, len(other))
    assert again.stats().get("load_failures", 0) == 0
    again.assert_empty()
    local = make(tmp_path, f"file://{tmp_path / 'unused'}", pipelined, load_mode=load_mode)  # vLLM's own cache
    run_one(local, "a", stored)
    hit = local.scheduler.kv_cache_manager.get_computed_blocks(local.add("b", other, max_tokens=1))[1]
    assert hit == local_hit(shared, len(other))


def test_without_block_hits_a_hit_ends_on_whole_chunks(tmp_path, store) -> None:
    stored = prompt(300)
    run_one(make(tmp_path, store, block_hits=False), "a", stored)
    e = make(tmp_path, store, block_hits=False)
    run_one(e, "b", sharing(stored, 170, 320))
    assert loaded_tokens(e, "b") == 128
    assert e.scheduler_stats().get("tail_saves_planned", 0) == 0
    e.assert_empty()


def test_every_stored_object_gets_a_ref_per_whole_block_prefix(tmp_path, store) -> None:
    """300 tokens at chunk 64, block 16: 4 chunks (3 refs each) and a 32-token tail (2 refs, one its own)."""
    e = make(tmp_path, store)
    run_one(e, "a", prompt(300))
    stats = e.stats()
    assert stats["saved_chunks"] == 5
    assert stats["saved_refs"] == 4 * (CHUNK // BLOCK - 1) + 2
    assert 0 < stats["saved_ref_bytes"] <= 150 * stats["saved_refs"]  # bound to their SHA-256 keys: about 143 bytes


@pytest.mark.parametrize("load_mode", ["sync", "async"])
@SCHEDULING
def test_the_next_turn_of_a_chat_loads_every_block_the_first_computed(tmp_path, store, load_mode, pipelined) -> None:
    """Turn 1 (100-token prompt, 50-token answer) ends inside chunk 2; the finishing tail (prompt and answer past
    chunk 1, whole blocks up to the last token's) is saved while vLLM holds the blocks, then freed. Turn 2 on a
    fresh engine (turn 1's tokens and a new message) loads every block turn 1 computed, as vLLM's own cache holds."""
    turn1 = prompt(100)
    e = make(tmp_path, store, pipelined, load_mode=load_mode)
    req = run_one(e, "turn1", turn1, max_tokens=50)
    assert len(req.output_token_ids) == 50
    assert e.scheduler_stats()["finish_tail_saves_planned"] == 1
    e.assert_empty()  # the blocks held for the tail were freed once it was gathered
    computed = len(turn1) + 50 - 1  # every token but the last sampled one has KV: 144 in whole blocks
    turn2 = turn1 + list(req.output_token_ids) + prompt(30, 5)
    f = make(tmp_path, store, pipelined, load_mode=load_mode)
    run_one(f, "turn2", turn2)
    assert loaded_tokens(f, "turn2") == computed // BLOCK * BLOCK
    assert f.stats().get("load_failures", 0) == 0
    f.assert_empty()


def test_an_aborted_request_saves_no_finishing_tail(tmp_path, store) -> None:
    e = make(tmp_path, store)
    e.add("a", prompt(100), max_tokens=40)
    for _ in range(5):
        e.step()
    e.abort("a")
    e.run()
    e.flush()
    assert e.scheduler_stats().get("finish_tail_saves_planned", 0) == 0
    e.assert_empty()
