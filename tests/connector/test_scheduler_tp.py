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
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

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
    chunk_2 = scheduler.requests["r"].hashes[2]
    assert step.rank_reports[0].loads["r"].failed == ([chunk_2] if 0 in failing else [])
    assert e.scheduler.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS", "vLLM waits for rank 1 too"
    assert scheduler.ledger.inflight_requests() == ["r"], "settled before rank 1 reported"
    assert scheduler.requests["r"].failures_seen == 0

    gate.set()
    assert e.ranks[1].connector.worker._async_jobs["r"].done.wait(60)
    step = e.step()  # rank 1 reports its failure now, a step after rank 0
    assert step.rank_reports[1].loads["r"].failed == [chunk_2]
    assert step.finished_recving == {"r"}, "vLLM's aggregator: both ranks have reported"
    assert not scheduler.ledger.inflight_requests()
    assert scheduler.requests["r"].failures_seen == 1, "the failure is counted against its request, once"
    assert scheduler.requests["r"].next_save == 2, "its chunks from the failed one on are saved again"

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


# ---- a save never rests on another rank's failed load (issue #51, item 1) ------------------------------------
def loadable(engine: Engine, tokens: list[int], chunk: int, tail: int = 0) -> bool:
    """Whether a lookup would find chunk ``chunk`` of ``tokens`` (or, ``tail``, the tail of that many tokens after
    it): every object of it, every rank's (one for a replicated cache), is stored."""
    from vllm_kvcodec.keys.chain import chunk_hashes, chunk_object_keys, tail_hash

    ns = engine.connector.scheduler.namespace
    hashes = chunk_hashes(ns, tokens, chunk + (0 if tail else 1))
    h = tail_hash(ns, tokens, hashes, tail) if tail else hashes[chunk]
    keys = chunk_object_keys(ns, h, engine.tp, len(ns.layer_groups()))
    return all(engine.connector.scheduler.store.exists_many(keys))


@pytest.mark.parametrize("replicated", [True, False], ids=["replicated", "split"])
def test_no_save_of_a_step_in_which_another_ranks_load_failed_becomes_loadable(tmp_path, store, replicated) -> None:
    """Rank 1's sync load fails, rank 0's lands; the step computes chunks 2 and 3 and the prompt's tail over the
    blocks rank 1 never got, so every rank's KV of them is wrong (their outputs are all-reduced).

    Before: rank 0, judging by its own load only, saved them. A replicated cache (MLA's latent: rank 0 writes the
    one object) was then complete and wrong, its claim kept the recompute from saving it again, and a fresh engine
    loaded wrong KV. A split cache's chunk 2 was made whole by rank 1's older shard of it. Now every rank holds
    such saves until the scheduler half has every rank's outcome of the load: the failure drops them, unwritten.
    """
    from storage.testing.faults import FaultInjector

    p = prompt(150)
    e = make(tmp_path, store, replicated=replicated)
    e.add("producer", p[:100], max_tokens=1)  # chunks 0-2
    e.run()
    e.flush()
    ns = e.connector.scheduler.namespace
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    chunk_2 = chunk_hashes(ns, p, 3)[2]
    for g in range(len(ns.layer_groups())):
        e.connector.scheduler.store.delete(object_key(ns, chunk_2, 0, g))
    assert loadable(e, p, 1) and not loadable(e, p, 2), "rank 0's chunk 2 is gone (rank 1's, if split, is not)"
    e.shutdown()

    fetcher: dict[str, Any] = {}

    def fail_rank_1(engine: Engine, out: Any) -> None:
        fetch = engine.ranks[1].connector.worker.fetcher
        if "store" in fetcher:
            fetch.store = fetcher.pop("store")  # its later loads (none: a sync failure is recomputed) read again
        elif any(spec.req_id == "r" for spec in out.kv_connector_metadata.loads):
            fetcher["store"] = fetch.store
            fetch.store = FaultInjector(fetch.store, drop=1.0)  # every object missing, for rank 1 only

    f = make(tmp_path, store, replicated=replicated, hooks={"before_forward": fail_rank_1})
    f.add("r", p, max_tokens=2)
    failed = f.step()
    assert loads_of(f, ["r"]) and failed.rank_reports[1].loads["r"].failed and not failed.rank_reports[0].loads["r"].failed
    over_failed = {s.chunk_hash for s in failed.saves if s.req_id == "r"}
    assert len(over_failed) == 3, "chunks 2, 3 and the prompt's tail were computed in the failed step"
    f.flush()  # whatever the ranks handed to their savers is stored now
    for what in ((2, 0), (3, 0), (4, 16)):
        assert not loadable(f, p, *what), f"{what}: an object computed over rank 1's failed load is loadable"

    f.run()
    f.flush()
    assert f.stats(0)["saves_dropped_after_load_failure_elsewhere"] == 3
    assert f.scheduler_stats().get("saves_deduplicated", 0) == 0, "the recompute saved them itself"
    f.assert_empty()
    for what in ((2, 0), (3, 0), (4, 16)):
        assert loadable(f, p, *what), f"{what}: the recompute saved it"
    assert reload(make(tmp_path, store, replicated=replicated), p) == 144, "every rank reads exactly the right KV"


def test_saves_after_a_load_wait_for_every_ranks_outcome_then_land(tmp_path, store) -> None:
    """The load lands on both ranks: the step's saves are held until the scheduler half has both outcomes (the
    next step's plan), then stored; until then they are not in the store (a lookup misses them)."""
    p = prompt(150)
    stored(tmp_path, store, p[:70])
    e = make(tmp_path, store)
    e.add("r", p, max_tokens=3)
    first = e.step()
    assert loads_of(e, ["r"]) and {s.req_id for s in first.saves} == {"r"}
    e.flush()
    assert not loadable(e, p, 2), "held for rank 1's outcome, not written"
    assert all(e.stats(rank)["saves_held_for_load_outcome"] == 3 for rank in (0, 1))
    e.step()  # its plan carries the load's outcome on every rank: the held saves go to the savers
    e.flush()
    assert loadable(e, p, 2) and loadable(e, p, 3) and loadable(e, p, 4, 16)
    e.run()
    e.flush()
    e.assert_empty()
    assert reload(make(tmp_path, store), p) == 144
