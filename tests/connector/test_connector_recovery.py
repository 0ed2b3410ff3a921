"""Failures on the load path never give wrong tokens or a hang: corrupted objects, a dead store, a slow link.

float32 engines: there, any split between loaded and recomputed tokens gives
exactly the tokens of a full recompute, so "correct" is unambiguous.
"""

from __future__ import annotations

import time

import pytest

from tests.support.engine import connector_config, engine, greedy, worker_connector
from tests.support.engine_pool import connected
from vllm_kvcodec.connector.facade import live_connectors

pytestmark = pytest.mark.engine


def scheduler_stats() -> dict:
    return next(c for c in reversed(live_connectors()) if c.scheduler is not None).stats()


def test_corrupted_object_is_recomputed(ids, recompute_tokens, engines) -> None:
    from storage import open_store
    from vllm_kvcodec.keys.block_refs import is_ref_key

    e = engines.get(connected(codec="splitzip", chunk_size=128, dtype="float32"))
    greedy(e.llm, ids)
    assert e.conn.flush(120)
    with open_store(e.url) as store:
        keys = sorted(k for k in store.keys() if not is_ref_key(k))  # a chunk object, not a block ref
        victim = keys[len(keys) // 2]
        blob = bytearray(store.get(victim))
        blob[len(blob) // 2] ^= 0x10
        store.put(victim, bytes(blob))
    e.llm.reset_prefix_cache()
    assert greedy(e.llm, ids) == recompute_tokens
    stats = e.counters()
    assert stats["load_failures"] >= 1 and stats["loaded_tokens"] > 0


def test_dead_store_means_recompute_not_hang(ids, recompute_tokens) -> None:
    """An engine of its own: its store is a redis-server this test kills."""
    from storage.testing.redis_server import start_redis_server

    server = start_redis_server()
    try:
        with engine(connector_config(server.url + "?socket_timeout=1&socket_connect_timeout=1", "rans", chunk_size=128), dtype="float32") as llm:
            conn = worker_connector()
            greedy(llm, ids)
            assert conn.flush(120) and conn.stats()["saved_chunks"] == 7
            server.kill()
            # Saves of the run below fail too: counted, never raised.
            llm.reset_prefix_cache()
            started = time.monotonic()
            assert greedy(llm, ids) == recompute_tokens
            assert time.monotonic() - started < 60
            assert scheduler_stats()["lookup_failures"] >= 1
    finally:
        server.stop()


def test_slow_link_times_out_and_recomputes(ids, recompute_tokens, engines) -> None:
    store = "link+file://{root}?gbps=0.05&rtt_ms=1"
    e = engines.get(connected(store, codec="raw", chunk_size=128, load_timeout_s=0.5, fetch_threads=2, dtype="float32"))
    greedy(e.llm, ids)
    assert e.conn.flush(300)
    e.llm.reset_prefix_cache()
    started = time.monotonic()
    assert greedy(e.llm, ids) == recompute_tokens
    assert time.monotonic() - started < 60
    assert e.counters()["load_timeouts"] >= 1
