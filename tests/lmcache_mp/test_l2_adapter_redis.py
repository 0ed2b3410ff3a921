"""Our plug-in L2 adapter over a real Redis (and Redis Cluster, Mooncake Store), with and without a kvcodec serde, through LMCache's StorageManager.

LMCache builds the adapter from ``{"type": "plugin", "module_path": "vllm_kvcodec.lmcache_mp", ...}``
(importing the package is also what registers the serdes). Exact-size serdes store
only their compressed bytes here, which the adapter reads back into LMCache's
larger buffer; the bytes each codec stores are measured against the serde-less adapter.
"""

from __future__ import annotations

import redis
import torch

import pytest

from tests.lmcache_mp.harness import (
    evict_l1, fetch, keys_for, l1_drained, plugin_adapter, same_bits, storage_manager, store,
)
from vllm_kvcodec.lmcache_mp.object_keys import object_name

pytestmark = pytest.mark.redis

SERDES = [None, "kvcodec-raw", "kvcodec-splitzip", "kvcodec-zstd", "kvcodec-rans", "kvcodec-auto"]


def stored_bytes(url: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        return {k.decode(): client.strlen(k) for k in client.scan_iter("*")}
    finally:
        client.close()


def round_trip(url: str, serde: str | None, chunks: list[torch.Tensor]) -> int:
    """Store, evict from L1, read back bit-exact; the bytes the store holds."""
    keys = keys_for(len(chunks))
    with storage_manager(plugin_adapter(url, {"type": serde} if serde else None)) as sm:
        store(sm, keys, chunks)
        held = stored_bytes(url)
        assert len(held) == len(keys)
        evict_l1(sm)
        got = fetch(sm, keys, chunks[0])
        assert all(g is not None and same_bits(g, want) for g, want in zip(got, chunks, strict=True))
        assert l1_drained(sm)
    return sum(held.values())


def test_bytes_stored_per_serde(redis_url: str, mp_chunks: list[torch.Tensor]) -> None:
    """Every serde round-trips bit-exact through Redis; prints each one's ratio against the serde-less adapter."""
    client = redis.Redis.from_url(redis_url)
    sizes = {}
    for serde in SERDES:
        client.flushdb()
        sizes[serde] = round_trip(redis_url, serde, mp_chunks)
    client.close()
    raw = sum(c.numel() * c.element_size() for c in mp_chunks)
    for serde, size in sizes.items():
        print(f"{serde or 'no serde'}: {size} bytes for {raw} bytes of KV, ratio {raw / size:.3f}")
    assert sizes[None] - raw == 32 * len(mp_chunks)  # the adapter's record header and checksum only
    assert raw < sizes["kvcodec-raw"] < raw * 1.001
    assert raw / sizes["kvcodec-splitzip"] > 1.25
    assert raw / sizes["kvcodec-zstd"] > 1.35
    assert raw / sizes["kvcodec-rans"] > 1.35
    assert sizes["kvcodec-auto"] == sizes["kvcodec-rans"]  # auto picks rans for bf16


@pytest.mark.parametrize("serde", [None, "kvcodec-zstd"])
def test_corrupted_redis_value_is_a_miss(redis_url: str, mp_chunks: list[torch.Tensor], serde: str | None) -> None:
    """A flipped bit in one stored value: that key is a miss (with or without a serde), never wrong bytes."""
    keys = keys_for(2)
    with storage_manager(plugin_adapter(redis_url, {"type": serde} if serde else None)) as sm:
        store(sm, keys, mp_chunks[:2])
        client = redis.Redis.from_url(redis_url)
        name = object_name(keys[1])
        value = bytearray(client.get(name))
        value[len(value) // 2] ^= 0x01
        client.set(name, bytes(value))
        client.close()
        evict_l1(sm)
        got = fetch(sm, keys, mp_chunks[0])
        assert got[1] is None
        assert all(g is None or same_bits(g, want) for g, want in zip(got, mp_chunks[:2], strict=True))
        assert l1_drained(sm)


def test_swapped_values_are_misses(redis_url: str, mp_chunks: list[torch.Tensor]) -> None:
    """Two intact values exchanged between keys: checksums pass, the key binding does not."""
    keys = keys_for(2)
    with storage_manager(plugin_adapter(redis_url, {"type": "kvcodec-rans"})) as sm:
        store(sm, keys, mp_chunks[:2])
        client = redis.Redis.from_url(redis_url)
        a, b = object_name(keys[0]), object_name(keys[1])
        va, vb = client.get(a), client.get(b)
        client.set(a, vb)
        client.set(b, va)
        client.close()
        evict_l1(sm)
        assert fetch(sm, keys, mp_chunks[0]) == [None, None]
        assert l1_drained(sm)


def test_fp8_kv_named_codec_refuses_auto_stores(redis_url: str, mp_chunks: list[torch.Tensor]) -> None:
    """fp8 KV: kvcodec-rans cannot hold it (nothing stored), kvcodec-auto (zstd-3) and kvcodec-zstd store it bit-exact."""
    fp8 = [c.float().clamp(-400, 400).to(torch.float8_e4m3fn) for c in mp_chunks[:2]]
    keys = keys_for(2)
    with storage_manager(plugin_adapter(redis_url, {"type": "kvcodec-rans"})) as sm:
        store(sm, keys, fp8)
        assert stored_bytes(redis_url) == {}
    for serde in ("kvcodec-auto", "kvcodec-zstd"):
        redis.Redis.from_url(redis_url).flushdb()
        with storage_manager(plugin_adapter(redis_url, {"type": serde})) as sm:
            store(sm, keys, fp8)
            evict_l1(sm)
            got = fetch(sm, keys, fp8[0])
            assert all(g is not None and same_bits(g, want) for g, want in zip(got, fp8, strict=True))
            assert l1_drained(sm)


def test_codec_change_keeps_reading_old_objects(redis_url: str, mp_chunks: list[torch.Tensor]) -> None:
    """Objects kvcodec-zstd wrote are read by a server reconfigured to kvcodec-rans: chunks name their codec."""
    keys = keys_for(2)
    with storage_manager(plugin_adapter(redis_url, {"type": "kvcodec-zstd"})) as sm:
        store(sm, keys, mp_chunks[:2])
    with storage_manager(plugin_adapter(redis_url, {"type": "kvcodec-rans"})) as sm:
        got = fetch(sm, keys, mp_chunks[0])
        assert all(g is not None and same_bits(g, want) for g, want in zip(got, mp_chunks[:2], strict=True))
        assert l1_drained(sm)


@pytest.mark.parametrize("backend", ["redis-cluster", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_other_stores_by_url(request: pytest.FixtureRequest, mp_chunks: list[torch.Tensor], backend: str) -> None:
    """The same adapter over a Redis Cluster and a Mooncake Store pool, by URL alone: stored, evicted, read bit-exact."""
    url = request.getfixturevalue("redis_cluster_url" if backend == "redis-cluster" else "mooncake_url")
    keys = keys_for(2, tag=7)
    with storage_manager(plugin_adapter(url, {"type": "kvcodec-rans"})) as sm:
        store(sm, keys, mp_chunks[:2])
        evict_l1(sm)
        got = fetch(sm, keys, mp_chunks[0])
        assert all(g is not None and same_bits(g, want) for g, want in zip(got, mp_chunks[:2], strict=True))
        assert l1_drained(sm)
