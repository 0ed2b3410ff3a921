"""The near tier (``cache+``): near first, far in the background, LRU within its cap, damage dropped and re-read.

Every test runs real stores (memory, file, a real redis-server, the fault
injector) and checks bytes, not calls: what the far store holds, what the near
store holds, and what a reader gets.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from storage import StoreError, StoreURLError, check_url, open_store
from storage.file_store import FileStore
from storage.memory_store import MemoryStore
from storage.near_tier import NearTier
from storage.ranged import TRAILER_BYTES, seal
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.format import decode_chunk, encode_chunk


def name() -> str:
    return f"near-test-{uuid.uuid4().hex}"


def value(i: int, size: int = 1000) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(size))


def tier(far: str, near: str = "memory://", near_bytes: str = "1M", **extra: str) -> NearTier:
    query = "&".join(f"{k}={v}" for k, v in {"near": near, "near_bytes": near_bytes, **extra}.items())
    store = open_store(f"cache+{far}{'&' if '?' in far else '?'}{query}")
    assert isinstance(store, NearTier)
    return store


def test_writes_reach_both_tiers_and_reads_are_near_hits(tmp_path: Path) -> None:
    far_name = name()
    with tier(f"memory://{far_name}", f"file://{tmp_path}/near") as t:
        t.put_many([(f"kvc/a/{i}", value(i)) for i in range(3)])
        assert t.flush(10)
        far = MemoryStore(far_name)
        assert [far.get(f"kvc/a/{i}") for i in range(3)] == [value(i) for i in range(3)]
        near = FileStore(tmp_path / "near")
        assert near.get("kvc/a/1") == seal("kvc/a/1", value(1))  # the near copy: value + trailer
        assert t.get_many([f"kvc/a/{i}" for i in range(3)]) == [value(i) for i in range(3)]
        c = t.tier_counters()
        assert (c["near_hits"], c["far_reads"], c["far_writes"], c["far_write_bytes"]) == (3, 0, 3, 3000)


def test_a_far_hit_fills_the_near_tier_and_the_next_read_stays_near(tmp_path: Path) -> None:
    far_name = name()
    MemoryStore(far_name).put("kvc/b/0", value(7, 5000))  # written by another instance
    with tier(f"memory://{far_name}", f"file://{tmp_path}/near") as t:
        assert t.get("kvc/b/0") == value(7, 5000)
        assert t.tier_counters()["far_reads"] == 1 and t.tier_counters()["near_fills"] == 1
        MemoryStore(far_name).delete("kvc/b/0")  # the far copy goes: the near one still serves
        assert t.get("kvc/b/0") == value(7, 5000)
        c = t.tier_counters()
        assert (c["near_hits"], c["far_reads"], c["far_read_bytes"]) == (1, 1, 5000)


def test_exists_many_asks_the_far_store_only_for_what_the_near_tier_lacks() -> None:
    far = open_store("faults+memory://?down=0")
    with NearTier(far, MemoryStore(), 1 << 20) as t:
        t.put_many([("kvc/c/0", value(0)), ("kvc/c/1", value(1))])
        assert t.flush(10)
        far.down()  # a far store that cannot answer: near-held keys must not ask it
        assert t.exists_many(["kvc/c/0", "kvc/c/1"]) == [True, True]
        assert t.tier_counters()["far_lookups"] == 0
        far.up()
        assert t.exists_many(["kvc/c/0", "kvc/c/1", "kvc/c/2"]) == [True, True, False]
        assert t.tier_counters()["far_lookups"] == 1


def test_the_memory_near_tier_evicts_least_recently_used_within_its_cap() -> None:
    far_name = name()
    size = 1000 + TRAILER_BYTES
    with tier(f"memory://{far_name}", "memory://", str(3 * size)) as t:
        t.put_many([(f"kvc/d/{i}", value(i)) for i in range(3)])
        t.get("kvc/d/0")  # 0 is now the most recently used: 1 goes first
        t.put("kvc/d/3", value(3))
        assert t.flush(10)
        held = [t.near.exists(f"kvc/d/{i}") for i in range(4)]
        assert held == [True, False, True, True]
        assert t.tier_counters()["near_evictions"] == 1
        assert t.get("kvc/d/1") == value(1)  # evicted near, still in the far store
        assert t.tier_counters()["far_reads"] == 1
        near_bytes = sum(len(t.near.get(k) or b"") for k in list(t.near.keys()))
        assert near_bytes <= 3 * size


def test_the_file_near_tier_stays_under_its_cap_and_counts_evictions(tmp_path: Path) -> None:
    with tier(f"memory://{name()}", f"file://{tmp_path}/near", "20k") as t:
        for i in range(60):
            t.put(f"kvc/e/{i}", value(i))
        assert t.flush(10)
        files = [p for p in (tmp_path / "near").rglob("*") if p.is_file() and not p.name.startswith(".")]
        assert sum(p.stat().st_size for p in files) <= 20_000
        assert t.tier_counters()["near_evictions"] > 0
        assert all(t.get(f"kvc/e/{i}") == value(i) for i in range(60))  # every one from near or far


def test_a_far_store_that_refuses_a_write_leaves_no_near_copy_and_is_counted() -> None:
    far = open_store("faults+memory://?down=1")
    with NearTier(far, MemoryStore(), 1 << 20) as t:
        t.put("kvc/f/0", value(0))  # returns: the far write runs in the background
        assert t.flush(10)
        assert not t.near.exists("kvc/f/0")
        c = t.tier_counters()
        assert (c["far_write_failures"], c["far_writes"]) == (1, 0)
        far.up()
        assert t.get("kvc/f/0") is None and not t.exists("kvc/f/0")


@pytest.mark.parametrize("near_kind", ["file", "memory"])
def test_a_damaged_near_copy_is_dropped_and_read_again_from_far(tmp_path: Path, near_kind: str) -> None:
    near = FileStore(tmp_path / "near") if near_kind == "file" else MemoryStore()
    with NearTier(MemoryStore(), near, 1 << 20, self_capped=near_kind == "file") as t:
        t.put("kvc/g/0", value(5, 4000))
        assert t.flush(10)
        sealed = bytearray(near.get("kvc/g/0"))
        sealed[1234] ^= 0x10
        near.put("kvc/g/0", bytes(sealed))  # bit rot in the near copy
        assert t.get("kvc/g/0") == value(5, 4000)
        assert t.tier_counters()["near_damaged"] == 1 and t.tier_counters()["far_reads"] == 1
        assert near.get("kvc/g/0") == seal("kvc/g/0", value(5, 4000))  # refilled, intact
        near.put("kvc/g/0", bytes(sealed[:5]))  # torn below its trailer
        assert t.get("kvc/g/0") == value(5, 4000)
        assert t.tier_counters()["near_damaged"] == 2


def test_a_near_copy_under_another_key_is_damage_not_a_hit() -> None:
    near = MemoryStore()
    with NearTier(MemoryStore(), near, 1 << 20) as t:
        t.put_many([("kvc/h/0", value(0)), ("kvc/h/1", value(1))])
        assert t.flush(10)
        near.put("kvc/h/0", near.get("kvc/h/1"))  # intact bytes, wrong key
        assert t.get("kvc/h/0") == value(0)
        assert t.tier_counters()["near_damaged"] == 1


def test_reads_in_place_from_a_file_near_tier_check_the_copy_as_they_go(tmp_path: Path) -> None:
    near = FileStore(tmp_path / "near")
    with NearTier(MemoryStore(), near, 1 << 20, self_capped=True) as t:
        assert t.ranged_reads
        t.put("kvc/i/0", value(9, 10_000))
        assert t.flush(10)
        with t.open_ranged("kvc/i/0") as v:  # the reader's pattern: the head, then the rest in place
            assert v.size == 10_000
            head = v.read(0, 64)
            rest = bytearray(10_000 - 32)
            v.read_into(32, [memoryview(rest)])
        assert head + bytes(rest[32:]) == value(9, 10_000)
        path = next(p for p in (tmp_path / "near").rglob("*") if p.is_file() and not p.name.startswith("."))
        raw = bytearray(path.read_bytes())
        raw[-TRAILER_BYTES - 100] ^= 1  # damage on disk, past the head
        path.write_bytes(bytes(raw))
        with t.open_ranged("kvc/i/0") as v:
            v.read(0, 64)
            with pytest.raises(StoreError, match="damaged"):
                v.read_into(64, [memoryview(bytearray(10_000 - 64))])
        assert not near.exists("kvc/i/0") and t.tier_counters()["near_damaged"] == 1
        with t.open_ranged("kvc/i/0") as v:  # from the far store, and the near tier filled again
            assert v.read(0, v.size) == value(9, 10_000)
        assert near.get("kvc/i/0") == seal("kvc/i/0", value(9, 10_000))


def test_a_faulty_far_store_never_makes_the_tier_return_wrong_bytes() -> None:
    inner_name = name()
    inner = MemoryStore(inner_name)
    for i in range(30):
        inner.put(f"kvc/j/{i}", value(i))
    with tier(f"faults+memory://{inner_name}?seed=3&drop=0.5") as t:
        for _ in range(6):
            got = t.get_many([f"kvc/j/{i}" for i in range(30)])
            assert all(g is None or g == value(i) for i, g in enumerate(got))
        assert t.get_many([f"kvc/j/{i}" for i in range(30)]).count(None) < 30
        c = t.tier_counters()
        assert c["near_hits"] > 0 and c["far_reads"] == c["near_fills"] <= 30


def test_a_slow_far_store_back_pressures_put_without_losing_writes() -> None:
    far_name = name()
    with tier(f"link+memory://{far_name}?gbps=0.01&rtt_ms=1", far_queue_bytes="3000", far_threads="1") as t:
        for i in range(6):
            t.put(f"kvc/k/{i}", value(i, 2000))
        assert t.tier_counters()["far_queue_waits"] >= 1
        assert t.flush(30)
    far = MemoryStore(far_name)
    assert [far.get(f"kvc/k/{i}") for i in range(6)] == [value(i, 2000) for i in range(6)]


def test_close_waits_for_queued_far_writes() -> None:
    far_name = name()
    t = tier(f"link+memory://{far_name}?gbps=0.01&rtt_ms=50")
    t.put("kvc/l/0", value(0, 20_000))
    t.close()
    assert MemoryStore(far_name).get("kvc/l/0") == value(0, 20_000)


def test_real_kv_chunks_round_trip_bit_exact_through_a_redis_far_store(redis_url: str, real_chunks: list[torch.Tensor],
                                                                         tmp_path: Path) -> None:
    codec = get_codec("splitzip")
    blobs = {f"kvc/m/{i}": encode_chunk(c, codec, key=f"kvc/m/{i}") for i, c in enumerate(real_chunks)}
    with tier(redis_url, f"file://{tmp_path}/a", "64M") as writer:
        writer.put_many(list(blobs.items()))
        assert writer.flush(30)
    with open_store(redis_url) as far:
        assert far.get_many(list(blobs)) == list(blobs.values())
    with tier(redis_url, f"file://{tmp_path}/b", "64M") as reader:  # another instance, its own near tier
        for _ in range(2):
            got = reader.get_many(list(blobs))
            for (key, blob), chunk, g in zip(blobs.items(), real_chunks, got):
                assert g == blob and torch.equal(decode_chunk(g, key=key).view(torch.int16), chunk.view(torch.int16))
        c = reader.tier_counters()
        assert (c["far_reads"], c["near_hits"], c["far_read_bytes"]) == (4, 4, sum(map(len, blobs.values())))


@pytest.mark.parametrize("url, message", [
    ("cache+memory://", "needs near="),
    ("cache+memory://?near=memory://", "needs near="),
    ("cache+memory://?near=memory://&near_bytes=lots", "not a size"),
    ("cache+memory://?near=redis://h:1/0&near_bytes=1G", "file:// or memory://"),
    ("cache+memory://?near=file:///tmp/x%3Fmax_bytes%3D1G&near_bytes=1G", "unknown option"),
    ("cache+memory://?near=memory://&near_bytes=1G&far_threads=0", "must be >= 1"),
    ("cache+memory://?near=memory://&near_bytes=1G&colour=red", "unknown option"),
    ("cache+redis://h:6379/0?near=memory://&near_bytes=1G&read_timout=1", "did you mean read_timeout"),
])
def test_bad_cache_urls_are_one_clear_error(url: str, message: str) -> None:
    with pytest.raises(StoreURLError, match=message):
        check_url(url)  # what the connector's config runs: the same refusal, nothing opened
    with pytest.raises(StoreURLError, match=message):
        open_store(url)


def test_reads_in_memory_of_a_cache_url_is_its_far_stores(tmp_path: Path) -> None:
    from storage import reads_in_memory

    assert reads_in_memory(f"cache+file://{tmp_path}/far?near=memory://&near_bytes=1M")
    assert not reads_in_memory(f"cache+redis://h:1/0?near=file://{tmp_path}/n&near_bytes=1M")
    with tier(f"memory://{name()}") as t:
        assert t.reads_in_memory and not t.ranged_reads


def test_tier_counters_reach_the_connectors_metrics_through_the_outage_guard() -> None:
    from prometheus_client import CollectorRegistry

    from storage.outage import OutageGuard
    from tests.connector.test_prom_metrics import get, prom
    from vllm_kvcodec.connector.transfer_stats import KVCodecTransferStats
    from vllm_kvcodec.stats import ConnectorStats, StoreTierCounters

    far_name = name()
    MemoryStore(far_name).put("kvc/n/0", value(0))
    store = OutageGuard(f"cache+memory://{far_name}?near=memory://&near_bytes=1M", open_store)  # as the connector opens it
    stats, tiers, registry = ConnectorStats(), StoreTierCounters(store), CollectorRegistry()
    metrics = prom(registry)
    for _ in range(3):
        store.get("kvc/n/0")
        tiers.add_growth(stats)  # what the connector does each time vLLM takes its stats
        metrics.observe(KVCodecTransferStats(data=stats.take_interval()).data)
    assert get(registry, "vllm:kvcodec_tier_reads_total", tier="near") == 2
    assert get(registry, "vllm:kvcodec_tier_reads_total", tier="far") == 1
    assert get(registry, "vllm:kvcodec_tier_read_bytes_total", tier="far") == 1000
    assert get(registry, "vllm:kvcodec_tier_read_bytes_total", tier="near") == 2000
    store.close()


def test_the_fetcher_reads_in_place_from_a_file_near_tier_and_recovers_from_a_damaged_copy(tmp_path: Path) -> None:
    """The real Fetcher, raw page objects: the first load reads the far store (and fills the near tier), the second
    reads the near files straight into the pages, a damaged near copy fails its blocks once and is read far again."""
    from storage.outage import OutageGuard
    from tests.connector.test_reads_in_place import DEST, Setup, _check_loaded
    from vllm_kvcodec.paged import CpuAttnVecLayout

    s = Setup(tmp_path, CpuAttnVecLayout)  # its objects in a file store: the far store here
    url = f"cache+{s.url}?near=file://{tmp_path}/near&near_bytes=64M"
    store = OutageGuard(url, open_store)  # as the connector opens it
    try:
        tier = store.inner
        assert store.ranged_reads
        caches, stats, failed = s.load(store, DEST)  # near misses: read far, as bytes
        assert not failed
        _check_loaded(s, caches)
        assert tier.tier_counters()["far_reads"] == 6 and tier.tier_counters()["near_fills"] == 6
        caches, stats, failed = s.load(store, DEST)  # near hits, read in place
        assert not failed and stats.totals()["objects_read_in_place"] == 6
        _check_loaded(s, caches)
        assert tier.tier_counters()["near_hits"] == 6 and tier.tier_counters()["far_reads"] == 6
        victim = next(p for p in sorted((tmp_path / "near").rglob("*")) if p.is_file() and not p.name.startswith("."))
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        victim.write_bytes(bytes(raw))
        caches, stats, failed = s.load(store, DEST)
        assert failed and tier.tier_counters()["near_damaged"] == 1  # that object's blocks are recomputed
        caches, stats, failed = s.load(store, DEST)  # and the next load has it from the far store again
        assert not failed
        _check_loaded(s, caches)
        assert tier.tier_counters()["far_reads"] == 7
    finally:
        store.close()
        s.store.close()


def test_the_connector_in_vllms_scheduler_loads_through_a_near_tier_and_reports_its_counters(tmp_path: Path) -> None:
    """Both halves of the real connector in vLLM's real Scheduler (tests.support.scheduler_harness): a producer
    saves through its near tier into the far store, a consumer with its own near tier loads from far, right KV."""
    import warnings

    from tests.support.scheduler_harness import Engine, loaded_tokens, prompt

    far = f"file://{tmp_path}/far"
    p = prompt(300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        producer = Engine(tmp_path, f"cache+{far}?near=memory://{name()}&near_bytes=64M")
        producer.add("a", p, max_tokens=1)
        producer.run()
        producer.flush()
        producer.assert_empty()
        producer.shutdown()  # closing the store waits for its far writes
        assert len(list(FileStore(tmp_path / "far").keys())) > 0
        consumer = Engine(tmp_path, f"cache+{far}?near=memory://{name()}&near_bytes=64M")
        consumer.add("b", p[:250] + prompt(30, 1), max_tokens=3)
        consumer.run()  # the harness checks every step's KV bit for bit
        assert loaded_tokens(consumer, "b") == 250 // 16 * 16  # every shared block (block_hits)
        consumer.worker.get_kv_connector_stats()
        totals = consumer.worker.worker.stats.totals()
        assert totals["tier_far_reads"] == totals["loaded_objects"] > 0
        assert totals["tier_far_read_bytes"] == totals["loaded_bytes"]
        consumer.assert_empty()
        consumer.shutdown()
