"""Tensor parallelism in vLLM's real Scheduler: two worker halves, one per rank, each over its own KV heads.

On :mod:`tests.support.scheduler_harness` with ``tp=2``: each rank saves and
loads its own objects, and vLLM's ``KVOutputAggregator`` hands the scheduler
what their outputs add up to. Every rank runs every load, and an async load
may end on one rank steps after the other: the scheduler half settles it only
when both reported (issue #41, item 6), so a failure on the slower rank is
counted once, with its load (its blocks evicted, its request rewound and its
chunks saved again), and no rank keeps dropping the request's saves.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, loaded_tokens, loads_of, prompt, reload

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def make(tmp_path: Path, store: str, **kw: Any) -> Engine:
    return Engine(tmp_path, store, tp=2, **kw)


def stored(tmp_path: Path, store: str, tokens: list[int]) -> None:
    e = make(tmp_path, store)
    e.add("producer", tokens, max_tokens=1)
    e.run()
    e.flush()
    e.assert_empty()
    e.shutdown()


def rank_keys(engine: Engine, tokens: list[int], chunk: int, rank: int) -> list[str]:
    """Rank ``rank``'s objects (every layer group) of chunk ``chunk`` of ``tokens``."""
    from vllm_kvcodec.keys import chunk_hashes, object_key

    ns = engine.connector.scheduler.namespace
    h = chunk_hashes(ns, tokens, chunk + 1)[chunk]
    return [object_key(ns, h, rank, g) for g in range(len(engine.worker.worker.groups))]


def hold_loads(engine: Engine, rank: int) -> threading.Event:
    """Rank ``rank``'s fetch threads wait for the returned gate before each batch: a rank slower than the other."""
    fetcher = engine.ranks[rank].connector.worker.fetcher
    gate, load_batch = threading.Event(), fetcher._load_batch

    def held(*args: Any) -> None:
        assert gate.wait(60), "the test never opened the gate"
        load_batch(*args)

    fetcher._load_batch = held
    return gate


def test_each_rank_saves_and_loads_its_own_heads(tmp_path, store) -> None:
    from storage import open_store

    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store)
    with open_store(store) as s:
        for rank in (0, 1):
            assert all(s.exists(k) for k in rank_keys(e, p, 8, rank)), f"rank {rank}'s objects were not saved"
    e.add("r", p[:290], max_tokens=2)
    e.run()  # every step checks what each rank's attention reads, bit for bit
    assert loaded_tokens(e, "r") == 288
    assert all(e.stats(rank)["loaded_tokens"] == 288 for rank in (0, 1))
    e.assert_empty()


@pytest.mark.parametrize("failing", [[1], [0, 1]], ids=["rank1", "both-ranks"])
def test_a_rank_failing_a_step_after_the_other_finished_counts_once_and_keeps_saving(tmp_path, store,
                                                                                      failing) -> None:
    """Async loads at TP=2: rank 0 reports its load in one step, rank 1 fails the same load a step later.

    Settled with rank 0's report, rank 1's failure found no load: it was not
    counted against the request (failures_seen), its blocks were not evicted,
    its chunks not planned again, and rank 1, knowing of a failure the plans
    never acknowledged, dropped every later save of the request. With both
    ranks failing, the failure was counted twice.
    """
    p = prompt(300)
    stored(tmp_path, store, p)
    state: dict[str, Any] = {}

    def damage(engine: Engine, out: Any) -> None:
        from storage import open_store

        if out.kv_connector_metadata.loads and not state:
            state["load"] = out.kv_connector_metadata.loads[0].load_id
            with open_store(store) as s:  # after the lookup found them, before either rank fetches
                for rank in failing:
                    for key in rank_keys(engine, p, 2, rank):
                        s.delete(key)

    e = make(tmp_path, store, load_mode="async", hooks={"before_forward": damage})
    gate = hold_loads(e, 1)
    e.add("r", p[:290], max_tokens=2)
    scheduler = e.connector.scheduler
    for _ in range(50):  # until rank 0 has reported the load (its fetch runs beside the harness's steps)
        step = e.step()
        if step.rank_reports[0] and "r" in step.rank_reports[0].loads:
            break
    else:
        raise AssertionError("rank 0 never reported its load")
    chunk_2 = scheduler._requests["r"].hashes[2]
    assert step.rank_reports[0].loads["r"].failed == ([chunk_2] if 0 in failing else [])
    assert e.scheduler.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS", "vLLM waits for rank 1 too"
    assert scheduler.ledger.inflight_requests() == ["r"], "settled before rank 1 reported"
    assert scheduler._requests["r"].failures_seen == 0

    gate.set()
    assert e.ranks[1].connector.worker._async_jobs["r"].done.wait(60)
    step = e.step()  # rank 1 reports its failure now, a step after rank 0
    assert step.rank_reports[1].loads["r"].failed == [chunk_2]
    assert step.finished_recving == {"r"}, "vLLM's aggregator: both ranks have reported"
    assert not scheduler.ledger.inflight_requests()
    assert scheduler._requests["r"].failures_seen == 1, "the failure is counted against its request, once"
    assert scheduler._requests["r"].next_save == 2, "its chunks from the failed one on are saved again"

    e.run()
    e.flush()
    assert e.scheduler_stats()["failed_load_chunks"] == 1
    assert e.scheduler_stats()["blocks_evicted_after_load_failure"] > 0
    for rank in (0, 1):
        assert not e.stats(rank).get("saves_skipped_after_load_failure"), f"rank {rank} dropped saves"
    recompute = [s for step in e.steps for s in step.saves if s.req_id == "r"]
    assert recompute and all(not s.unsettled_loads for s in recompute)
    assert len(loads_of(e, ["r"])) == 1
    e.assert_empty()
    assert reload(make(tmp_path, store), p[:290]) == 288, "both ranks saved the recomputed chunks again"
