"""Prefetch in vLLM's real Scheduler: a request whose lookup found its prefix but that waits for blocks has its
objects fetched ahead by the worker; its load takes them (checked like any fetched object), an abort drops them.

The store is a file store behind the link emulator (prefetch is for stores across a network); the harness checks
every step's KV bit for bit.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.support.scheduler_harness import Engine, loaded_tokens, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SAME_OBJECTS = {"layers_per_object": 1}
#: 21 usable blocks of 16 tokens: "first" (300 tokens and its answer) holds 19, "waiting" needs 19 more.
FEW_BLOCKS = {"num_blocks": 22}


def setup(tmp_path: Path, lookup: str, pipelined: bool = False, **kw: Any) -> tuple[Engine, list[int]]:
    url = f"file://{tmp_path / 'store'}"
    p = prompt(300)
    producer = Engine(tmp_path, url, lookup="sync", **SAME_OBJECTS)
    producer.add("producer", p, max_tokens=1)
    producer.run()
    producer.flush()
    producer.assert_empty()
    producer.shutdown()
    e = Engine(tmp_path, f"link+{url}?gbps=1&rtt_ms=2", lookup=lookup, async_scheduling=pipelined, **SAME_OBJECTS,
               **FEW_BLOCKS, **kw)
    e.add("first", prompt(300, 5), max_tokens=12)
    e.admit()
    e.add("waiting", p[:290], max_tokens=2)
    return e, p


def wait_for_prefetch(e: Engine) -> None:
    prefetcher = e.worker.worker.prefetcher
    for held in list(prefetcher._held.values()):
        held.future.result(30)


@pytest.mark.parametrize("lookup", ["sync", "async"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])
def test_a_waiting_request_loads_what_was_fetched_ahead(tmp_path, lookup, pipelined) -> None:
    e, _ = setup(tmp_path, lookup, pipelined)
    e.step()
    e.step()  # the lookup answered; no blocks for it yet: its objects are fetched ahead
    assert "waiting" not in e.scheduler.running and e.worker.worker.prefetcher.held_bytes() > 0
    wait_for_prefetch(e)
    e.run()
    assert loaded_tokens(e, "waiting") == 288
    stats = e.stats()
    assert stats["prefetched_bytes"] > 0 and stats["prefetch_used_bytes"] == stats["prefetched_bytes"]
    assert stats.get("prefetch_wasted_bytes", 0) == 0 and stats.get("load_failures", 0) == 0
    e.step()  # an empty step delivers the last plan (what the worker may drop)
    assert e.worker.worker.prefetcher.held_bytes() == 0
    e.assert_empty()


def test_an_abort_drops_what_was_fetched_ahead(tmp_path) -> None:
    e, _ = setup(tmp_path, "async")
    e.step()
    e.step()
    wait_for_prefetch(e)
    fetched = e.stats()["prefetched_bytes"]
    e.abort("waiting")
    e.run()
    e.step()
    stats = e.stats()
    assert stats["prefetch_wasted_bytes"] == fetched and stats.get("prefetch_used_bytes", 0) == 0
    assert e.worker.worker.prefetcher.held_bytes() == 0 and not e.worker.worker.prefetcher.waiting()
    e.assert_empty()


def test_bytes_fetched_ahead_are_checked_at_load_time(tmp_path) -> None:
    """A prefetched object damaged in memory: the load's checks refuse it, its blocks are recomputed."""
    e, _ = setup(tmp_path, "async")
    e.step()
    e.step()
    wait_for_prefetch(e)
    prefetcher = e.worker.worker.prefetcher
    held = next(iter(prefetcher._held.values()))
    blob = bytearray(held.future.result())
    blob[len(blob) // 2] ^= 0x10
    held.future = Future()
    held.future.set_result(bytes(blob))
    e.run()
    assert e.stats()["load_failures"] >= 1  # the harness checked that no step read wrong KV
    e.step()
    e.assert_empty()


def test_no_prefetch_for_a_store_on_this_host(tmp_path) -> None:
    e = Engine(tmp_path, f"file://{tmp_path / 'store'}")
    assert e.worker.worker.prefetcher is None and not e.connector.scheduler.loads.prefetches
    e2 = Engine(tmp_path, f"link+file://{tmp_path / 'store'}?gbps=1", prefetch_bytes=0)
    assert e2.worker.worker.prefetcher is None


def test_a_key_claimed_twice_before_it_is_taken_keeps_no_budget(tmp_path) -> None:
    """A load claims an object fetched ahead; before its fetch thread takes it, another waiting request has it
    fetched ahead again and a second load claims that copy. Each take gets one copy and frees its budget (the
    second claim used to replace the first, whose bytes then stayed reserved for good)."""
    from storage import open_store
    from vllm_kvcodec.load.prefetch import Prefetcher
    from vllm_kvcodec.stats import ConnectorStats

    with open_store(f"file://{tmp_path / 'store'}") as store:
        store.put("k", b"x" * 1000)
        stats = ConnectorStats()
        prefetcher = Prefetcher(store, budget=1 << 20, stats=stats)
        try:
            prefetcher.start("a", [("k", 2000)])
            prefetcher.claim(["k"])  # a's load
            prefetcher.start("b", [("k", 2000)])  # b still waits: fetched ahead again
            prefetcher.claim(["k"])  # b's load, before a's fetch thread took its copy
            assert prefetcher.held_bytes() == 4000
            assert prefetcher.take(["k"]) == [b"x" * 1000]  # a's load
            assert prefetcher.take(["k"]) == [b"x" * 1000]  # b's load: its own copy, not a fetch of its own
            assert prefetcher.held_bytes() == 0
            assert stats.totals()["prefetch_used_bytes"] == 2000
            assert prefetcher.take(["k"]) == [None]  # nothing claimed is left: a third load fetches it itself
        finally:
            prefetcher.shutdown()
