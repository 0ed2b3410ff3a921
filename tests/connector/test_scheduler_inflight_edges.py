"""Two lifecycle edges of loads in flight, step by step in vLLM's real Scheduler (issue #32).

Both would serve KV that was never written: the harness's context check
raises :class:`~tests.support.scheduler_harness.Violation` when a request
computes over it.

- A prompt that diverges *inside* a chunk another request is loading has its
  own hash for that chunk, yet vLLM's block-granular prefix cache gives it the
  loading request's blocks as a local hit (a sync load's blocks are registered
  at allocation). It must wait for that load's outcome like a request that
  shares the chunk's hash.
- A request id reused while the aborted request's failed-load report is still
  on its way: the late report must settle the load it is about (evict its
  blocks, mark its chunks failed), not the new request's.
- A request id reused right after a request whose load failed: the worker
  hears of the old request's end only after the new one's first saves, and
  must not take the old request's failure for the new one's (issue #41).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.connector.test_scheduler_lifecycle import damage_when_loaded, stored
from tests.support.scheduler_harness import Engine, Violation, loaded_tokens, loads_of, prompt, reload

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]

BLOCK, CHUNK = 16, 128
#: What a 290-token prompt of a stored 300-token one loads: whole chunks (256), or with block-granular hits every
#: block but the last token's (288).
LOADABLE = (256, 288)
SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])


def make(tmp_path: Path, store: str, pipelined: bool = False, **kw: Any) -> Engine:
    kw = {"block_size": BLOCK, "chunk_size": CHUNK, "max_batched": 1024, **kw}
    return Engine(tmp_path, store, async_scheduling=pipelined, **kw)


# ---- a local hit reaching into another request's load ------------------------------------------
def diverging_inside_a_loading_chunk(tmp_path: Path, store: str, pipelined: bool, w_arrives: str) -> Engine:
    """r loads chunks 0 and 1, and chunk 0 fails; w shares chunk 0's first 96 tokens (6 blocks), then differs.

    ``w_arrives``: "with-r" (both admitted in one step: w's local hit is r's
    blocks allocated a moment before), or "next-step" (the issue's timing
    under async scheduling: w is scheduled before r's failed step is
    delivered). Under async scheduling vLLM does not rewind w far enough when
    the failure is delivered, and w reads KV computed over the unwritten
    blocks; under sync scheduling vLLM rewinds w itself (the failure is
    delivered before w's next step), and what this checks there is that w
    waits, as it does for a chunk whose key it shares.
    """
    p = prompt(300)
    stored(tmp_path, store, p, block_size=BLOCK, chunk_size=CHUNK)
    hook = damage_when_loaded(store, p, chunk=0, how="delete")  # nothing of it is written (a corrupt one may be, in part)
    e = make(tmp_path, store, pipelined, hooks={"before_forward": hook["hook"]})
    w = p[:96] + prompt(200, 1)
    e.add("r", p[:290], max_tokens=2)
    if w_arrives == "next-step":
        e.step()  # lookup sync: r is admitted and loads; async: r is asked (and loads in the step that asks w)
    e.add("w", w, max_tokens=4)
    e.run()  # w's context check catches KV it computed over blocks that were never written
    assert hook["done"] and any(step.invalid_blocks for step in e.steps), "r's load did not fail"
    assert e.scheduler_stats()["lookups_waiting_for_inflight_load"] >= 1, "w did not wait for r's load"
    e.assert_empty()
    return e


@SCHEDULING
def test_a_prompt_diverging_inside_a_chunk_in_flight_waits_for_its_outcome(tmp_path, store, pipelined) -> None:
    diverging_inside_a_loading_chunk(tmp_path, store, pipelined, "with-r")


def test_issue_timing_async_scheduling_w_scheduled_before_the_failure_is_delivered(tmp_path, store) -> None:
    diverging_inside_a_loading_chunk(tmp_path, store, True, "next-step")


def test_a_successful_load_is_a_local_hit_once_it_landed(tmp_path, store) -> None:
    """The wait costs w a step, not its hit: once r's load landed, w takes r's blocks of chunk 0 locally."""
    p = prompt(300)
    stored(tmp_path, store, p, block_size=BLOCK, chunk_size=CHUNK)
    e = make(tmp_path, store)
    e.add("r", p[:290], max_tokens=2)
    e.add("w", p[:96] + prompt(200, 1), max_tokens=2)
    e.run()
    assert loaded_tokens(e, "r") in LOADABLE and not loads_of(e, ["w"])
    assert first_computed(e, "w") == 96
    e.assert_empty()


def test_the_harness_catches_a_local_hit_on_blocks_in_flight(tmp_path, store, monkeypatch) -> None:
    """Without the check over local-hit blocks, w computes over r's never-written blocks (async scheduling)."""
    from vllm_kvcodec.connector.load_ledger import LoadLedger

    monkeypatch.setattr(LoadLedger, "writes_any", lambda self, block_ids: False)
    with pytest.raises(Violation, match="w read wrong KV"):
        diverging_inside_a_loading_chunk(tmp_path, store, True, "with-r")


# ---- a request id reused while a failed load's report is late ----------------------------------
@SCHEDULING
def test_a_late_report_of_an_aborted_request_settles_its_own_load_not_its_ids_successor(
        tmp_path, store, pipelined) -> None:
    """r's load fails at chunk 1; its report is late (withheld). r is aborted and a new request "r" (another
    prompt) starts its own load; the late report arrives while that load is in flight. It must evict the first
    r's blocks from chunk 1 on (vLLM's recompute policy leaves them in its prefix cache), and leave the new r's
    load in flight until its own report."""
    p, q = prompt(300), prompt(300, 5)
    for tokens in (p, q):
        stored(tmp_path, store, tokens, block_size=BLOCK, chunk_size=CHUNK)
    damage = damage_when_loaded(store, p, chunk=1, how="delete")
    seen: dict[str, Any] = {}

    def hook(engine: Engine, out: Any) -> None:
        damage["hook"](engine, out)
        if any(spec.req_id == "r" for spec in out.kv_connector_metadata.loads) and damage["done"] and not seen:
            if engine.requests["r"].prompt_token_ids == q[:290]:  # the new r's load is planned: now the late report
                ledger = engine.connector.scheduler.ledger
                seen["inflight_before"] = ledger.inflight_requests()
                engine.deliver_withheld()
                seen["inflight_after"] = ledger.inflight_requests()

    e = make(tmp_path, store, pipelined, hooks={"before_forward": hook})
    e.withhold_load_reports = True
    e.add("r", p[:290], max_tokens=2)
    e.admit()  # the load of chunks 0 and 1 fails at chunk 1; its outcome is withheld
    assert damage["done"] and e.steps[-1].invalid_blocks
    failed = set(e.steps[-1].loads[0].chunks[1].block_ids)
    e.deliver()  # (async scheduling) vLLM sees that step's output, without the connector's report
    e.abort("r")
    e.withhold_load_reports = False
    e.add("r", q[:290], max_tokens=2)  # the same id, another prompt: its own load
    e.run()
    assert "inflight_after" in seen, "the new r's load was never planned"
    e.add("third", p[:290], max_tokens=2)  # r's prompt: the failed blocks would be its local hit
    e.run()  # its context check catches KV that was never written
    assert first_computed(e, "third") == 128  # chunk 0 is a local hit; chunk 1 failed, so it is computed
    assert not failed & e.cached_block_ids(), "blocks whose load failed are still in the prefix cache"
    assert seen["inflight_before"] == ["r", "r"], "the new r's load dropped the first r's from the ledger"
    assert seen["inflight_after"] == ["r"], "the late report settled the new r's load"
    first, second = loads_of(e, ["r"])
    assert sum(c.tokens for c in second.chunks) in LOADABLE  # the new r's own load
    assert e.scheduler_stats()["failed_load_chunks"] == 1
    assert not [s for step in e.steps for s in step.saves if s.req_id == "r"], \
        "the new r saves chunks it loaded: the late report reset its hit"
    e.assert_empty()


def first_computed(e: Engine, req_id: str) -> int:
    return next(s.computed_before[req_id] for s in e.steps if req_id in s.computed_before)


@SCHEDULING
def test_a_new_request_under_the_id_of_one_whose_load_failed_keeps_its_saves(tmp_path, store, pipelined) -> None:
    """r's load fails and r is aborted; a new request "r" (another prompt, nothing stored) computes two chunks
    in the very step that tells the worker the first r ended. Keyed by request id, the old failure made the
    worker drop the new r's saves as resting on a load that failed."""
    p, q = prompt(300), prompt(300, 7)
    stored(tmp_path, store, p, block_size=BLOCK, chunk_size=CHUNK)
    damage = damage_when_loaded(store, p, chunk=1, how="delete")
    e = make(tmp_path, store, pipelined, hooks={"before_forward": damage["hook"]})
    e.add("r", p[:290], max_tokens=2)
    e.admit()  # the load fails at chunk 1
    assert damage["done"] and e.steps[-1].invalid_blocks
    e.deliver()
    e.abort("r")
    e.add("r", q, max_tokens=2)  # the same id: its first step carries the first r's end to the worker
    e.run()
    new_saves = [s for step in e.steps[damage["step"] + 1 :] for s in step.saves if s.req_id == "r"]
    assert new_saves, "the new r planned no save"
    assert not e.stats().get("saves_skipped_after_load_failure"), "the new r's saves were dropped"
    e.flush()
    assert e.stats()["saved_chunks"] >= 2
    e.assert_empty()
    assert reload(make(tmp_path, store), q) in LOADABLE  # what the new r saved
