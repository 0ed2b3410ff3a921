"""The connector with vLLM's hybrid KV cache manager (SupportsHMA): several KV cache groups, sliding windows, fp8.

On :mod:`tests.support.scheduler_harness` (vLLM's real Scheduler and hybrid
manager, the connector's real worker half over real paged KV, a fake model
whose window layers read only their window): plans carry per-group block ids,
a load writes exactly the blocks vLLM allocated for each group (a window
group's window, never its null blocks), saves gather each group's blocks in
the step that completes the chunk, and a failed load of a multi-group model is
reported per request (``failed_recving``), which vLLM recomputes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, Violation, loaded_tokens, loads_of, prompt, reload

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]


W = 40  # tokens; blocks of 16, chunks of 32: a window spans parts of 3 blocks
GEMMA = [W, W, W, None]  # three window layers and a full one: four KV cache groups
MISTRAL = [W, W]  # every layer windowed: one window group
KINDS = pytest.mark.parametrize("windows", [GEMMA, MISTRAL], ids=["gemma-like", "mistral-like"])
SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])


def make(tmp_path: Path, store: str, windows: list[int | None], pipelined: bool = False, **kw: Any) -> Engine:
    return Engine(tmp_path, store, windows=windows, async_scheduling=pipelined, **kw)


def stored(tmp_path: Path, store: str, tokens: list[int], windows: list[int | None], **kw: Any) -> None:
    e = make(tmp_path, store, windows, **kw)
    e.add("producer", tokens, max_tokens=1)
    e.run()
    e.flush()
    assert e.stats()["saved_chunks"] == len(tokens) // 32, "every chunk is stored, window layers included"
    e.assert_empty()
    e.shutdown()


@KINDS
@SCHEDULING
def test_stored_prefix_loads_each_groups_blocks(tmp_path, store, windows, pipelined) -> None:
    """A fresh engine loads the prefix: full groups every block, window groups only their window's blocks."""
    p = prompt(300)
    stored(tmp_path, store, p, windows, max_batched=64)  # a chunked prefill: windows move while chunks complete
    e = make(tmp_path, store, windows, pipelined)
    groups = e.kv_cache_config.kv_cache_groups
    assert len(groups) == (4 if windows == GEMMA else 1)
    e.add("b", p[:290] + prompt(30, 1), max_tokens=3)
    e.run()  # every step checks plans against the block tables, and what each window layer reads
    (spec,) = loads_of(e, ["b"])
    assert spec.is_async == (windows == GEMMA), "several KV cache groups: loads are async"
    hit = 9 * 32
    window_from = (hit - W + 1) // 16 * 16  # the first block the window of the hit needs
    for chunk in spec.chunks:
        for g, span in enumerate(chunk.spans):
            if e.windows[e.names.index(groups[g].layer_names[0])] is None:
                assert len(span.slots) == 32, "a full group loads every token"
    window_tokens = sum(len(c.spans[0].slots) for c in spec.chunks)
    assert window_tokens == hit - window_from < hit, "a window group loads its window's blocks only"
    if windows == MISTRAL:
        assert loaded_tokens(e, "b") == hit - window_from and len(spec.chunks) == 2  # earlier chunks not fetched
    else:
        assert loaded_tokens(e, "b") == hit
    e.assert_empty()


@KINDS
def test_window_kv_is_really_checked(tmp_path, store, windows, monkeypatch) -> None:
    """Negative control: a load that skips the window groups' blocks is caught (its next token reads wrong KV)."""
    from vllm_kvcodec.connector import load_planner
    from vllm_kvcodec.plans.spans import Span

    p = prompt(300)
    stored(tmp_path, store, p, windows)
    real = load_planner._span

    def full_only(table, block_size, a, b, chunk_start):
        span = real(table, block_size, a, b, chunk_start)
        return span if span.first_token + chunk_start == a else Span(b - chunk_start, [])

    monkeypatch.setattr(load_planner, "_span", full_only)
    e = make(tmp_path, store, windows)
    e.add("b", p[:290] + prompt(30, 1), max_tokens=2)
    with pytest.raises(Violation, match="leaves allocated blocks|wrong KV"):
        e.run()


@SCHEDULING
def test_multi_group_failed_load_is_reported_per_request_and_recomputed(tmp_path, store, pipelined) -> None:
    """vLLM raises on invalid_block_ids with several groups: the failure goes through failed_recving."""
    from tests.connector.test_scheduler_lifecycle import damage_when_loaded

    p = prompt(300)
    stored(tmp_path, store, p, GEMMA)
    hook = damage_when_loaded(store, p, chunk=3)
    e = make(tmp_path, store, GEMMA, pipelined, hooks={"before_forward": hook["hook"]})
    e.add("r", p[:290], max_tokens=2)
    e.run(max_steps=60)
    assert hook["done"]
    assert not any(step.invalid_blocks for step in e.steps), "block-level failures crash vLLM with several groups"
    assert e.requests["r"].num_computed_tokens > 0 and "r" in e.finished
    assert e.scheduler_stats()["failed_load_chunks"] >= 1
    e.flush()
    assert reload(make(tmp_path, store, GEMMA, pipelined), p[:290]) == 288  # the recompute replaced the damaged chunk
    e.assert_empty()


def test_a_failed_load_past_skipped_window_chunks_evicts_from_its_own_chunk(tmp_path, store) -> None:
    """Every layer windowed: the load of chunks 0..8 writes only chunks 7 and 8 (the window's blocks), the
    earlier ones have none and are left out of it. Chunk 8 fails: eviction from vLLM's prefix cache starts at
    chunk 8's first token, and chunk 7's block, loaded fine, stays a local hit (its first token was taken from
    the chunk's place in the load's list, not its number: chunk 8 was evicted from token 32 on)."""
    from tests.connector.test_scheduler_lifecycle import damage_when_loaded

    p = prompt(300)
    stored(tmp_path, store, p, MISTRAL)
    hook = damage_when_loaded(store, p, chunk=8, how="delete")
    e = make(tmp_path, store, MISTRAL, hooks={"before_forward": hook["hook"]})
    e.add("r", p[:290], max_tokens=2)
    e.admit()
    assert hook["done"] and e.steps[-1].invalid_blocks
    (spec,) = loads_of(e, ["r"])
    assert [c.first_token + n * 32 for c, n in zip(spec.chunks, (7, 8))] == [240, 256], "chunks 7 and 8, windowed"
    chunk_7_block, chunk_8_blocks = spec.chunks[0].block_ids, spec.chunks[1].block_ids
    cached = e.cached_block_ids()
    assert not set(chunk_8_blocks) & cached, "the failed chunk's blocks are still a local hit"
    assert set(chunk_7_block) <= cached, "a chunk that loaded fine was evicted with the failed one"
    # Aborted before its recompute, which this test is not about: vLLM rewinds r to chunk 8, and the window of
    # its first token there reaches back into blocks the load's hit never allocated (vLLM's null block).
    e.abort("r")
    e.run()
    e.assert_empty()


def test_a_save_retry_after_the_window_moved_on_is_dropped(tmp_path, store) -> None:
    """A save that did not land is planned again only while a window group still holds its blocks."""
    from vllm_kvcodec.keys.chain import chunk_hashes
    from vllm_kvcodec.plans.outcomes import SaveOutcome

    p = prompt(200)

    def lose_chunk0(engine: Engine, out: Any) -> None:
        if len(engine.steps) == 3:  # chunk 0 was saved in step 0; its blocks are long out of the window
            h = chunk_hashes(engine.connector.scheduler.namespace, p, 1)[0]
            engine.connector.scheduler.saves.settled(SaveOutcome("r", h, landed=False))

    for windows, dropped in ((GEMMA, 1), ([None, None], 0)):
        e = make(tmp_path, f"{store}-{dropped}", windows, max_batched=32, hooks={"before_forward": lose_chunk0})
        e.add("r", p, max_tokens=1)
        e.run()  # a re-planned save naming freed (null) blocks would be a Violation
        assert e.scheduler_stats().get("saves_dropped_window_freed", 0) == dropped
        e.assert_empty()


def test_hma_start_up_refusals(tmp_path, store) -> None:
    from vllm_kvcodec.errors import ConfigError

    with pytest.raises(ConfigError, match="load_mode 'sync' cannot recover"):
        make(tmp_path, store, GEMMA, load_mode="sync")
    with pytest.raises(ConfigError, match="chunk_size <= 40"):
        make(tmp_path, store, GEMMA, chunk_size=64)
    assert make(tmp_path, store, MISTRAL, load_mode="sync").connector.scheduler.config.load_mode == "sync"


def test_window_layers_separate_keys(tmp_path, store) -> None:
    """Another window means other KV for every layer above it: namespaces differ."""
    full = make(tmp_path, store, [None, None]).connector.scheduler.namespace
    window = make(tmp_path, store, MISTRAL).connector.scheduler.namespace
    other = make(tmp_path, store, [48, 48]).connector.scheduler.namespace
    assert full.attention == "" and window.attention == "window:40,window:40"
    assert len({full.digest, window.digest, other.digest}) == 3


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("windows", [[None, None], GEMMA], ids=["full", "gemma-like"])
def test_fp8_caches_store_and_load(tmp_path, store, cache_dtype, windows) -> None:
    """fp8 bytes through the whole path: keyed with the cache dtype and the layers' scales, loaded bit-exactly."""
    import torch

    p = prompt(300)
    stored(tmp_path, store, p, windows, cache_dtype=cache_dtype)
    e = make(tmp_path, store, windows, cache_dtype=cache_dtype)
    ns = e.connector.scheduler.namespace
    assert ns.dtype == cache_dtype and ns.kv_scales and ns == e.worker.worker.namespace
    assert e.worker.worker.layouts[0].dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache_dtype]
    e.add("b", p[:290] + prompt(30, 1), max_tokens=2)
    e.run()  # its context check compares every byte it reads
    assert loaded_tokens(e, "b") == 288
    e.assert_empty()
    bf16 = make(tmp_path, store, windows)
    bf16.add("c", p[:290], max_tokens=1)
    bf16.run()
    assert loaded_tokens(bf16, "c") == 0, "a bf16 engine never finds fp8 chunks"
    bf16.assert_empty()


@KINDS
@SCHEDULING
@pytest.mark.parametrize("shared", [144, 150, 40])
def test_a_hit_ends_on_a_block_inside_a_stored_chunk_in_every_group(tmp_path, store, windows, pipelined, shared) -> None:
    """block_hits with several groups: a prompt sharing a stored one up to a block inside a chunk (or inside a
    block) is served its whole blocks through the chunk's block ref, each group's blocks (a window group's window
    only), and reads no KV that was never written."""
    p = prompt(300)
    stored(tmp_path, store, p, windows)
    other = p[:shared] + [t for t in prompt(200, 7) if t != p[shared]][:150]
    e = make(tmp_path, store, windows, pipelined)
    e.add("b", other, max_tokens=2)
    e.run()
    first = next(s.computed_before["b"] for s in e.steps if "b" in s.computed_before)
    assert first == shared // 16 * 16  # what vLLM's own cache would hit: every whole shared block
    assert e.stats().get("load_failures", 0) == 0
    e.assert_empty()
