"""What the workers and the scheduler report reaches Prometheus as counters and histograms, bounded on the way.

Real prometheus_client metrics (in a private registry) and vLLM's own
KVConnectorStats contract: several workers' stats aggregate, the scheduler's
are added, vLLM ships ``data`` and the connector's metrics observe it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_kvcodec.connector.prom_metrics import COUNTERS, HISTOGRAMS, KVCodecPromMetrics, exported_names
from vllm_kvcodec.connector.transfer_stats import KVCodecTransferStats
from vllm_kvcodec.stats import MAX_SAMPLES, ConnectorStats

LABELS = {"model_name": "m", "engine": "0"}


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
