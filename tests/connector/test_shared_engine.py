"""The shared engines of the engine tests (tests/support/engine_pool.py) hand each test an engine with nothing left
from the test before: vLLM's prefix cache, the connector's memory of the store, the store and the counters.

If a reset left any of them, a later test would pass or fail by what ran before it: a chunk found in the store,
a save suppressed by an earlier claim, a local hit instead of a load.
"""

from __future__ import annotations

import pytest

from storage import open_store
from tests.support.engine import BLOCK, greedy
from tests.support.engine_pool import connected

pytestmark = pytest.mark.engine

CONFIG = connected(codec="rans", chunk_size=BLOCK)


def test_the_next_test_gets_the_same_engine_with_nothing_left(engines) -> None:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(700)[:600]  # 4 chunks of 128 and a partial one
    first = engines.get(CONFIG)
    tokens = greedy(first.llm, ids)
    assert first.conn.flush(120) and first.counters()["saved_chunks"] == 4
    started = engines.started

    second = engines.get(CONFIG)  # what the next test of this configuration gets
    assert second is first and engines.started == started, "the live engine of the configuration, not a new one"
    assert first.counters() == {} and first.scheduler_counters() == {}
    with open_store(second.url) as store:
        assert not list(store.keys()), "the store was not emptied"
    assert greedy(second.llm, ids) == tokens
    assert second.conn.flush(120)
    stats = second.counters()
    # nothing from vLLM's cache or the store (no load), and saved again: no claim of the first run survived
    assert stats["saved_chunks"] == 4 and "loaded_tokens" not in stats, stats
    looked_up = second.scheduler_counters()
    assert looked_up["lookups"] >= 1 and looked_up.get("hit_chunks", 0) == 0, looked_up


def test_a_test_with_an_engine_of_its_own_stops_the_shared_one_first(engines) -> None:
    """vLLM's in-process engines share process-wide distributed groups: one alive at a time."""
    from tests.support.engine import engine, worker_connector

    shared = engines.get(CONFIG)
    with engine() as llm:
        assert engines.live is None and shared.llm is None
        assert greedy(llm, [1, 2, 3], max_tokens=2)
    with pytest.raises(AssertionError, match="no worker-side KVCodecConnector alive"):
        worker_connector()
