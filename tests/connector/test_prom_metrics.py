"""What the workers and the scheduler report reaches Prometheus as counters and histograms, bounded on the way.

Real prometheus_client metrics (in a private registry) and vLLM's own
KVConnectorStats contract: several workers' stats aggregate, the scheduler's
are added, vLLM ships ``data`` and the connector's metrics observe it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from storage.near_tier import COUNTER_NAMES as TIER_COUNTER_NAMES
from vllm_kvcodec.connector.lookup import _GIVEN_UP
from vllm_kvcodec.connector.prom_metrics import COUNTERS, HISTOGRAMS, NOT_EXPORTED, KVCodecPromMetrics, exported_names
from vllm_kvcodec.connector.transfer_stats import KVCodecTransferStats
from vllm_kvcodec.stats import MAX_SAMPLES, ConnectorStats

LABELS = {"model_name": "m", "engine": "0"}
PACKAGE = Path(__file__).resolve().parents[2] / "vllm_kvcodec"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def prom(registry: CollectorRegistry, chunk_size: int = 256) -> KVCodecPromMetrics:
    """The connector's metrics as vLLM builds them: its metric classes, its labels, one engine."""
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"chunk_size": chunk_size}))
    return KVCodecPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})


def get(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def worker_step(loaded_tokens: int, objects: int) -> dict:
    stats = ConnectorStats()
    stats.add(loaded_tokens=loaded_tokens, loaded_objects=objects, loaded_bytes=100 * objects,
              loaded_raw_bytes=300 * objects, load_failures=1, load_failures_corrupt=1, saves_dropped=2)
    for _ in range(objects):
        stats.sample(fetch_s=0.002, decode_s=0.004, scatter_s=0.001)
    stats.sample(load_s=0.05)
    return stats.take_interval()


def test_a_step_of_two_workers_and_the_scheduler_becomes_counters_and_histograms(registry) -> None:
    scheduler = ConnectorStats()
    scheduler.add(lookups=1, lookup_chunks=4, hit_chunks=3, saves_deduplicated=1, store_down_scheduler=1)
    step = KVCodecTransferStats(data=worker_step(768, 18)).aggregate(KVCodecTransferStats(data=worker_step(768, 18)))
    step = step.aggregate(KVCodecTransferStats(data=scheduler.take_interval()))
    metrics = prom(registry)
    metrics.observe(step.data)  # what vLLM's front-end does with each step's SchedulerStats.kv_connector_stats

    assert get(registry, "vllm:kvcodec_loaded_tokens_total") == 2 * 768
    assert get(registry, "vllm:kvcodec_hit_chunks_total") == 3
    assert get(registry, "vllm:kvcodec_hit_tokens_total") == 3 * 256
    assert get(registry, "vllm:kvcodec_load_failures_total", kind="corrupt") == 2
    assert get(registry, "vllm:kvcodec_load_failures_total", kind="missing") == 0
    assert get(registry, "vllm:kvcodec_saves_dropped_total", reason="queue_full") == 4
    assert get(registry, "vllm:kvcodec_saves_dropped_total", reason="deduplicated") == 1
    assert get(registry, "vllm:kvcodec_store_down_total", side="scheduler") == 1
    assert get(registry, "vllm:kvcodec_fetch_seconds_count") == 36
    assert get(registry, "vllm:kvcodec_fetch_seconds_bucket", le="0.0025") == 36
    assert get(registry, "vllm:kvcodec_fetch_seconds_bucket", le="0.001") == 0
    assert get(registry, "vllm:kvcodec_load_seconds_count") == 2
    assert get(registry, "vllm:kvcodec_load_seconds_sum") == pytest.approx(0.1)

    metrics.observe(step.data)  # counters add up step after step
    assert get(registry, "vllm:kvcodec_loaded_tokens_total") == 4 * 768


def test_every_series_is_named_once_and_exported(registry) -> None:
    prom(registry)
    names = {s.name for family in registry.collect() for s in family.samples}
    assert exported_names() <= names
    assert len({c.name for c in COUNTERS} | {h.name for h in HISTOGRAMS}) == len(COUNTERS) + len(HISTOGRAMS)


def test_samples_stay_bounded_per_step_and_in_the_logged_accumulation() -> None:
    stats = ConnectorStats()
    stats.sample(fetch_s=0.1)
    for _ in range(MAX_SAMPLES + 9):
        stats.sample(decode_s=0.1)
    data = stats.take_interval()
    assert len(data["samples"]["decode_s"]) == MAX_SAMPLES and data["samples_dropped"] == 9
    assert stats.take_interval() == {}  # the interval was taken
    logged = KVCodecTransferStats(data=data)
    for _ in range(3):  # vLLM's log line accumulates many steps
        logged = logged.aggregate(KVCodecTransferStats(data=data))
    assert len(logged.data["samples"]["decode_s"]) == MAX_SAMPLES
    reduced = logged.reduce()
    assert reduced["decode_s_p50_ms"] == 100.0 and "samples" not in reduced
    assert not logged.is_empty() and KVCodecTransferStats(data={}).is_empty()


def test_the_lookup_block_ref_tail_prefetch_and_event_counters_become_their_series(registry) -> None:
    """The counters added with async lookups, block hits, prefetch and KV events (issues #31, #32), as each side counts
    them in one step, read back by the names operators query."""
    scheduler = ConnectorStats()
    scheduler.add(lookup_batches=2, lookup_batch_requests=7, lookups_shared=3, lookup_retries=4, lookup_timeouts=1,
                  lookups_queue_full=2, lookups_waiting_for_inflight_load=5, lookup_failures=3, lookups_store_down=2,
                  refs_read=6, refs_invalid=1, hit_tail_tokens=96, tail_saves_planned=1, finish_tail_saves_planned=2,
                  saves_dropped_window_freed=1, uncacheable_requests=1, requests_before_cache_identity=2,
                  blocks_evicted_after_load_failure=4, kv_events_stored_blocks=16, kv_events_removed_blocks=8)
    worker = ConnectorStats()
    worker.add(saved_refs=7, saved_ref_bytes=7 * 60, ref_save_failures=1, saved_objects=6, put_s=0.25,
               prefetched_bytes=4000, prefetch_used_bytes=3000, prefetch_wasted_bytes=1000, prefetch_skipped_objects=2,
               upgrades_skipped_busy=3, upgrades_not_smaller=1, upgrade_failures=1, gpu_decoded_objects=9,
               tier_far_write_bytes=5000, tier_far_queue_waits=2, tier_near_fills=3, tier_near_fill_failures=1,
               tier_near_write_failures=1)
    step = KVCodecTransferStats(data=worker.take_interval()).aggregate(KVCodecTransferStats(data=worker_step(0, 0)))
    step = step.aggregate(KVCodecTransferStats(data=scheduler.take_interval()))
    prom(registry).observe(step.data)

    expected = {
        ("lookup_batches", ()): 2, ("lookup_batch_requests", ()): 7, ("lookups_shared", ()): 3,
        ("lookup_retries", ()): 4, ("lookups_given_up", (("reason", "timeout"),)): 1,
        ("lookups_given_up", (("reason", "queue_full"),)): 2, ("lookups_waiting_for_inflight_load", ()): 5,
        ("lookup_failures", ()): 3, ("lookups_store_down", ()): 2,
        ("block_refs_read", ()): 6, ("block_refs_invalid", ()): 1, ("hit_tail_tokens", ()): 96,
        ("tail_saves", (("tail", "prompt"),)): 1, ("tail_saves", (("tail", "finish"),)): 2,
        ("saves_dropped", (("reason", "window_freed"),)): 1, ("saves_dropped", (("reason", "queue_full"),)): 2,
        ("requests_not_cached", (("reason", "uncacheable"),)): 1,
        ("requests_not_cached", (("reason", "before_cache_identity"),)): 2,
        ("blocks_evicted_after_load_failure", ()): 4,
        ("kv_events_blocks", (("type", "stored"),)): 16, ("kv_events_blocks", (("type", "removed"),)): 8,
        ("saved_block_refs", ()): 7, ("saved_block_ref_bytes", ()): 420, ("block_ref_save_failures", ()): 1,
        ("saved_objects", ()): 6, ("put_seconds", ()): 0.25, ("gpu_decoded_objects", ()): 9,
        ("prefetched_bytes", ()): 4000, ("prefetch_used_bytes", ()): 3000, ("prefetch_wasted_bytes", ()): 1000,
        ("prefetch_skipped_objects", ()): 2,
        ("upgrades_skipped", (("reason", "busy"),)): 3, ("upgrades_skipped", (("reason", "not_smaller"),)): 1,
        ("upgrade_failures", ()): 1,
        ("tier_far_write_bytes", ()): 5000, ("tier_far_queue_waits", ()): 2,
        ("tier_near_fills", (("outcome", "ok"),)): 3, ("tier_near_fills", (("outcome", "failed"),)): 1,
        ("tier_near_write_failures", ()): 1,
    }
    got = {(name, labels): get(registry, f"vllm:kvcodec_{name}_total", **dict(labels)) for name, labels in expected}
    assert got == expected


def test_every_counter_of_the_table_reads_back_what_its_stats_keys_counted(registry) -> None:
    """Each (series, label value) adds exactly its own stats key: a distinct count per key, read back per series."""
    stats = ConnectorStats()
    keys = [key for spec in COUNTERS for key in spec.keys.values()]
    stats.add(**{key: i + 1 for i, key in enumerate(dict.fromkeys(keys))})
    data = stats.take_interval()
    prom(registry, chunk_size=128).observe(data)
    for spec in COUNTERS:
        for value, key in spec.keys.items():
            labels = {spec.label: value} if spec.label else {}
            want = data[key] * (128 if spec.scale == "chunk" else 1)
            assert get(registry, f"vllm:kvcodec_{spec.name}_total", **labels) == want, (spec.name, value)


def counted_keys() -> tuple[set[str], set[str]]:
    """The stats keys the package counts (``stats.add(key=...)``, literal dict keys spread into it), and the prefixes of
    keys it builds at run time (f-strings such as ``load_failures_{kind}``)."""
    keys, prefixes = set(), set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add"
                    and "stats" in ast.unparse(node.func.value)):
                continue
            keys |= {k.arg for k in node.keywords if k.arg}
            for spread in (k.value for k in node.keywords if k.arg is None):
                for inner in ast.walk(spread):
                    if isinstance(inner, ast.Dict):
                        keys |= {k.value for k in inner.keys if isinstance(k, ast.Constant)}
                        prefixes |= {k.values[0].value for k in inner.keys
                                     if isinstance(k, ast.JoinedStr) and isinstance(k.values[0], ast.Constant)}
    keys |= set(_GIVEN_UP.values()) | {f"tier_{name}" for name in TIER_COUNTER_NAMES} | {"samples_dropped"}
    return keys, prefixes


def test_every_counted_key_is_exported_or_left_out_on_purpose_and_every_exported_key_is_counted() -> None:
    keys, prefixes = counted_keys()
    assert {"refs_read", "lookup_batches", "kv_events_stored_blocks", "finish_tail_saves_planned"} <= keys  # found
    assert {"load_failures_", "store_down_", "codec_"} <= prefixes
    exported = {key for spec in COUNTERS for key in spec.keys.values()}
    assert keys - exported - set(NOT_EXPORTED) == set(), "counted but neither exported nor in NOT_EXPORTED"
    assert not exported & set(NOT_EXPORTED)
    assert {k for k in exported if not k.startswith(tuple(prefixes))} - keys == set(), "exported but never counted"
