"""A real engine behind a misbehaving store: the tokens of a fault-free run, no hang, every failure counted.

float32 engines with vLLM's own prefix cache off, so every repeated prefix is
loaded through the connector and any split between loaded and recomputed
tokens gives exactly the tokens of a full recompute (the reference).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from storage import open_store
from storage.testing.faults import FaultInjector, find_fault_injector
from tests.support.engine import connector_config, engine, greedy
from tests.support.engine_pool import connected, plain
from vllm_kvcodec.connector.facade import live_connectors

pytestmark = pytest.mark.engine

PREFIX = 384  # 3 chunks of 128
MAX_SECONDS_PER_REQUEST = 60
# A stream with shared prefixes: the first request of each prefix saves it, the others load it.
STREAM = [("a", 0), ("b", 1), ("a", 2), ("c", 3), ("b", 4), ("a", 5), ("c", 6), ("b", 7)]
FAULTS = "seed=3&drop=0.1&truncate=0.1&corrupt=0.1&swap=0.15&delay=0.05&delay_s=1.5"


@pytest.fixture(scope="module")
def prompts() -> dict[tuple[str, int], list[int]]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(2200)
    prefixes = {"a": ids[:PREFIX], "b": ids[500 : 500 + PREFIX], "c": ids[1000 : 1000 + PREFIX]}
    return {(p, s): prefixes[p] + ids[1500 + 60 * s : 1500 + 60 * s + 30 + 5 * s] for p, s in STREAM}


@pytest.fixture(scope="module")
def reference(prompts, engines) -> dict[tuple[str, int], list[int]]:
    llm = engines.get(plain("float32", prefix_caching=False)).llm
    return {key: greedy(llm, ids, max_tokens=6) for key, ids in prompts.items()}


def injectors() -> list[FaultInjector]:
    """The fault wrappers of both halves (scheduler: lookups; worker: loads and saves)."""
    found = []
    for conn in live_connectors():
        half = conn.scheduler or conn.worker
        found.append(find_fault_injector(half.store))
    return [f for f in found if f is not None][-2:]


def serve(llm, prompts, reference, keys, conn) -> None:
    """Each request in turn: its tokens are the reference's, within the time bound; saves land before the next."""
    for key in keys:
        started = time.monotonic()
        assert greedy(llm, prompts[key], max_tokens=6) == reference[key], key
        assert time.monotonic() - started < MAX_SECONDS_PER_REQUEST, key
        assert conn.flush(60)


def test_required_store_that_is_down_stops_the_engine_clearly() -> None:
    """First in the module, so the engines after it prove it left nothing behind. An engine of its own: its
    start-up is what is tested."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    config = connector_config("faults+memory://?down=1", "rans", chunk_size=128, require_store_at_startup=True)
    try:
        with pytest.raises(Exception, match="cannot be reached at start-up and require_store_at_startup is set"):
            with engine(config, dtype="float32", prefix_caching=False):
                pass
    finally:
        cleanup_dist_env_and_memory()  # the engine died half-built: free what it set up for the next one


@pytest.mark.parametrize("lookup", ["async", "sync"])  # async: what lookup auto gives any store off this host
def test_faulty_store_stream_gives_fault_free_tokens(prompts, reference, engines, lookup: str) -> None:
    # A fixed model_id fixes the keys, hence which reads the seed faults, on every machine.
    # No prefetch: every read must be a load's for the counts below (a read fetched ahead and never loaded, or a
    # delay absorbed while its request waited, is prefetch doing its job; tests/connector/test_lookup_prefetch.py).
    # Loads waited for whole: a load not whole by its deadline is abandoned then, so each delayed read (1.5 s under
    # a 1 s timeout) shows as a timeout. Waiting per layer, a late object is still used if it lands before the
    # prefill reaches its layers, which on a loaded host it may: whether a timeout showed depended on the host.
    # Both lookup modes: the scheduler's store is its own wrapper, so lookups (existence checks, no reads here)
    # draw no faults and leave the worker's seeded reads as they are.
    extra = {"chunk_size": 128, "load_timeout_s": 1.0, "layers_per_object": 10, "model_id": "smollm2-faults",
             "prefetch_bytes": 0, "lookup": lookup, "load_wait": "whole"}
    # Fresh: the seeded faults follow the sequence of reads since the engine started.
    e = engines.get(connected(f"faults+file://{{root}}?{FAULTS}", codec="rans", dtype="float32", prefix_caching=False,
                              **extra), fresh=True)
    serve(e.llm, prompts, reference, STREAM, e.conn)
    faults = find_fault_injector(e.conn.worker.store).counts()
    calls = find_fault_injector(e.conn.worker.store).calls_by_op()
    stats = e.counters()
    # Every read the faults could land on was a load's: one get_many per fetch batch that read (no probe, prefetch
    # or lookup; the scheduler's reads go through its own wrapper).
    assert calls.get("get", 0) == 0 and 0 < calls["get_many"] <= stats["fetch_batches"], (calls, stats)
    faulty_reads = faults["drop"] + faults["truncate"] + faults["corrupt"] + faults["swap"]
    assert faults["reads"] >= 25 and faulty_reads >= 5, faults
    # Every faulty read fails its object's load (objects refused after a timeout fail too).
    assert stats["load_failures"] >= faulty_reads, (stats, faults)
    assert stats.get("load_timeouts", 0) >= (1 if faults["delay"] else 0), stats
    # 3 chunks per prefix, and again each chunk whose load failed, by the request that recomputes it.
    assert stats["loaded_tokens"] > 0 and 9 <= stats["saved_chunks"] <= 9 + e.scheduler_counters()["failed_load_chunks"], stats


def outage(switch: Callable[[FaultInjector], None]) -> None:
    for faults in injectors():
        switch(faults)


def test_store_down_at_start_and_mid_run_serves_by_recompute_then_hits_again(prompts, reference, engines) -> None:
    extra = {"chunk_size": 128, "store_retry_s": 0.5}
    e = engines.get(connected("faults+file://{root}?down=1", codec="rans", dtype="float32", prefix_caching=False,
                              **extra), fresh=True)  # fresh: down from its start
    conn, root = e.conn, e.root
    assert len(injectors()) == 2 and all(f.is_down for f in injectors())
    # Down from the start: the engine serves by recompute; lookups miss and saves are dropped, counted.
    serve(e.llm, prompts, reference, [("a", 0), ("a", 2)], conn)
    assert e.scheduler_counters()["lookup_failures"] == 2
    stats = e.counters()
    # Each of the 6 chunk saves was deferred by the scheduler half, dropped or failed; none landed.
    lost = e.scheduler_counters().get("saves_deferred_store_down", 0) + stats.get("saves_dropped_store_down", 0)
    assert lost + stats.get("save_failures", 0) >= 6, stats
    assert "loaded_tokens" not in stats and "saved_chunks" not in stats
    assert not list(open_store(f"file://{root}").keys())
    # Back up: the next request saves its prefix, the one after loads it.
    outage(FaultInjector.up)
    time.sleep(0.6)
    serve(e.llm, prompts, reference, [("a", 5), ("a", 0)], conn)
    assert e.counters().get("loaded_tokens") == PREFIX, (e.counters(), e.scheduler_counters())
    # Down mid-run: recompute again, no hang; up again: hits resume.
    outage(FaultInjector.down)
    serve(e.llm, prompts, reference, [("a", 2), ("b", 1)], conn)
    assert e.counters()["loaded_tokens"] == PREFIX and e.scheduler_counters()["lookup_failures"] == 4
    outage(FaultInjector.up)
    time.sleep(0.6)
    serve(e.llm, prompts, reference, [("b", 4), ("b", 7), ("a", 5)], conn)
    assert e.counters()["loaded_tokens"] == 3 * PREFIX


def test_values_returned_for_other_keys_give_the_right_tokens(prompts, reference, engines) -> None:
    """A store that answers with other prompts' values (swapped objects, swapped refs, a ref bound to its own key
    but naming another prompt's object): each is a refused or failed load, recomputed, and the tokens are the
    reference's. Chunk 256 over blocks of 128: each prefix's last 128 tokens are a tail found through a ref."""
    from vllm_kvcodec.keys.block_refs import Ref, encode_ref, ref_key
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key, tail_hash

    extra = {"chunk_size": 256, "model_id": "smollm2-trust", "prefetch_bytes": 0}
    e = engines.get(connected(codec="rans", dtype="float32", prefix_caching=False, **extra))
    conn, llm, root = e.conn, e.llm, e.root
    serve(llm, prompts, reference, [("a", 0), ("b", 1)], conn)  # both prefixes: chunk 0, and a 128-token tail
    ns, store = conn.worker.namespace, open_store(f"file://{root}")
    a, b = prompts[("a", 0)], prompts[("b", 1)]

    def objects(tokens: list[int]) -> list[str]:
        return [object_key(ns, chunk_hashes(ns, tokens, 1)[0], 0, g) for g in range(len(ns.layer_groups()))]

    def tail_ref(tokens: list[int]) -> tuple[str, str]:
        prefix = tail_hash(ns, tokens, chunk_hashes(ns, tokens, 1), 128)
        return prefix, ref_key(ns, prefix)

    def swap(x: str, y: str) -> None:
        vx, vy = store.get(x), store.get(y)
        store.put(x, vy)
        store.put(y, vx)

    swap(tail_ref(a)[1], tail_ref(b)[1])  # b's ref in a's slot: bound to b's prefix, so no ref
    serve(llm, prompts, reference, [("a", 2)], conn)  # chunk 0 loads; the tail is computed (and saved again)
    assert e.scheduler_counters()["refs_invalid"] >= 1
    prefix, key = tail_ref(a)  # a's ref, rewritten: bound to its own key, naming b's tail
    store.put(key, encode_ref(prefix, 128, Ref(tail_hash(ns, b, chunk_hashes(ns, b, 1), 128), 128)))
    serve(llm, prompts, reference, [("a", 5)], conn)
    assert e.counters()["load_failures_tokens"] >= 1
    for x, y in zip(objects(a), objects(b)):  # b's chunk 0 in a's place: bound to b's key
        swap(x, y)
    serve(llm, prompts, reference, [("a", 0)], conn)
    assert e.counters()["load_failures_corrupt"] >= 1
