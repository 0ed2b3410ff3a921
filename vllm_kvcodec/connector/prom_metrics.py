"""The connector's series on vLLM's ``/metrics``, through vLLM's per-connector hook (``build_prom_metrics``).

vLLM builds this object in its front-end process, with its own metric classes
(multiprocess-aware when it runs several API servers) and its labels
(``model_name``, ``engine``), and calls :meth:`KVCodecPromMetrics.observe`
with each step's :class:`~.transfer_stats.KVCodecTransferStats` data, which the
workers and the scheduler reported. Counters add the step's counts; histograms
observe its samples (see :mod:`vllm_kvcodec.stats`).

The tables below are the one list of what is exported: docs/operations.md
describes them and the Grafana dashboard's test checks its queries against
:func:`exported_names`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_kvcodec.codecs.precision import LEVELS
from vllm_kvcodec.stats import SAMPLES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "vllm:kvcodec_"


@dataclasses.dataclass(frozen=True)
class CounterSpec:
    """One counter; ``keys`` maps a label value (or ``""`` for none) to the stats key it adds up."""

    name: str
    doc: str
    keys: dict[str, str]
    label: str = ""
    scale: str = ""  # "chunk": the stats key counts chunks, the counter tokens


def _plain(name: str, doc: str, key: str, scale: str = "") -> CounterSpec:
    return CounterSpec(name, doc, {"": key}, scale=scale)


def _by_precision(prefix: str) -> dict[str, str]:
    """One stats key per precision an object may hold (codecs/precision.py)."""
    return {name: prefix + name for name in ("lossless", *LEVELS)}


COUNTERS: tuple[CounterSpec, ...] = (
    _plain("lookups", "Requests whose prefix was looked up in the store.", "lookups"),
    _plain("lookup_chunks", "Whole chunks of prompt looked up in the store.", "lookup_chunks"),
    _plain("hit_chunks", "Chunks of the looked-up prefixes found in the store.", "hit_chunks"),
    _plain("hit_tokens", "Tokens of the looked-up prefixes found in the store (hit chunks x chunk_size).",
           "hit_chunks", scale="chunk"),
    _plain("hit_tail_tokens", "Tokens found right after the hit chunks, up to vLLM's block boundary, through block refs "
           "(block_hits; not in hit_tokens).", "hit_tail_tokens"),
    CounterSpec("tail_saves", "Tails (a last part shorter than a chunk, in whole blocks) planned for saving (block_hits; "
                "counted in saved_chunks once stored), by the tail: prompt (once the prompt is computed) or finish "
                "(when the request finishes, prompt and output).",
                {"prompt": "tail_saves_planned", "finish": "finish_tail_saves_planned"}, label="tail"),
    _plain("block_refs_read", "Block refs the lookups read from the store (block_hits: one per whole-block prefix asked "
           "about after the hit chunks).", "refs_read"),
    _plain("block_refs_invalid", "Block refs read that did not parse or were bound to another key (another format, "
           "damaged or misrouted; a shorter hit).", "refs_invalid"),
    _plain("session_updates", "Streaming-input sessions whose prompt or media grew under the same request: keyed anew "
           "from the first chunk that changed.", "session_updates"),
    _plain("block_refs_to_own_tail", "Block refs whose named object was gone while the tail stored under the ref's own "
           "prefix was not: that tail was loaded instead.", "refs_to_own_tail"),
    _plain("saved_block_refs", "Block refs written after an object landed (block_hits; by TP rank 0 only).", "saved_refs"),
    _plain("saved_block_ref_bytes", "Bytes of those block refs (the store space block_hits costs).", "saved_ref_bytes"),
    _plain("block_ref_save_failures", "Objects whose block refs failed to save (a shorter hit later, not a failed save).",
           "ref_save_failures"),
    _plain("loaded_tokens", "Tokens of KV loaded from the store into paged memory (summed over TP workers).",
           "loaded_tokens"),
    _plain("saved_tokens", "Tokens of KV saved to the store (summed over TP workers).", "saved_tokens"),
    _plain("loaded_objects", "Stored objects (chunk x layer group) loaded.", "loaded_objects"),
    _plain("objects_read_in_place", "Loaded objects read from a local file straight into their KV pages (raw page objects).",
           "objects_read_in_place"),
    _plain("objects_decoded_into_pages", "Loaded objects decoded straight into their KV pages (compressed page objects "
           "landing whole in host memory).", "objects_decoded_into_pages"),
    _plain("gpu_decoded_objects", "Loaded objects decoded on the GPU.", "gpu_decoded_objects"),
    _plain("saved_chunks", "Chunks saved to the store.", "saved_chunks"),
    _plain("saved_objects", "Stored objects (chunk x layer group) saved, summed over TP workers.", "saved_objects"),
    _plain("saves_behind", "Chunks saved while a full round of saves waited behind them (with save_codec_when_behind).",
           "saves_behind"),
    _plain("upgraded_objects", "Objects stored with save_codec_when_behind that a load fetched and the idle saver re-encoded "
           "with the configured codec, over the same key (upgrade_fallback_chunks).", "upgraded_objects"),
    _plain("upgraded_bytes_saved", "Store bytes those upgrades freed (compressed size before minus after).",
           "upgraded_bytes_saved"),
    CounterSpec("upgrades_skipped", "Upgrades not done, by reason: busy (the saver had work, or the store was down), "
                "not_smaller (the configured codec did not shrink the object; it stays as stored), superseded (the "
                "object was saved anew, deleted or evicted after the load read it; that stays).",
                {"busy": "upgrades_skipped_busy", "not_smaller": "upgrades_not_smaller",
                 "superseded": "upgrades_superseded"}, label="reason"),
    _plain("upgrade_failures", "Upgrades whose fetch, encode or put failed (the object stays as stored).",
           "upgrade_failures"),
    _plain("encode_seconds", "Thread-seconds the save threads spent encoding chunks.", "encode_s"),
    _plain("put_seconds", "Thread-seconds the save threads spent writing encoded chunks to the store.", "put_s"),
    _plain("saved_bytes", "Bytes written to the store (compressed).", "saved_bytes"),
    _plain("saved_raw_bytes", "Raw KV bytes of the chunks saved (before compression).", "saved_raw_bytes"),
    _plain("loaded_bytes", "Bytes read from the store (compressed).", "loaded_bytes"),
    _plain("loaded_raw_bytes", "Raw KV bytes of the objects loaded (after decompression).", "loaded_raw_bytes"),
    CounterSpec("load_failures", "Stored objects that failed to load (their blocks are recomputed), by kind.",
                {k: f"load_failures_{k}" for k in ("missing", "corrupt", "tokens", "mismatch", "store", "timeout", "other")},
                label="kind"),
    _plain("load_timeouts", "Loads abandoned at load_timeout_s (their blocks are recomputed).", "load_timeouts"),
    _plain("load_waits_whole", "Steps whose prefill waited for its whole sync load before the first layer (load_wait).",
           "load_waits_whole"),
    _plain("failed_load_chunks", "Chunks whose load failed, as the scheduler learnt (not offered again until saved anew).",
           "failed_load_chunks"),
    _plain("loads_abandoned", "Loads stopped because their request ended first.", "loads_abandoned"),
    _plain("loads_refused_adapter_weights", "Loads refused unread (their blocks are recomputed) because the LoRA "
           "adapter weights the worker runs were not read from the files the chunks' keys name (rewritten in place, "
           "or not loaded yet).", "loads_refused_adapter_weights"),
    _plain("lookup_failures", "Lookups the store could not answer (counted as misses).", "lookup_failures"),
    _plain("lookups_store_down", "Of lookup_failures, those answered at no cost as misses because the store was known "
           "down.", "lookups_store_down"),
    CounterSpec("lookups_given_up", "Lookups the scheduler stopped waiting for and counted as misses, by reason: timeout "
                "(no answer within lookup_timeout_s), queue_full (the lookup thread's queue was full).",
                {"timeout": "lookup_timeouts", "queue_full": "lookups_queue_full"}, label="reason"),
    _plain("lookup_batches", "Batches of lookups handed to the lookup thread (one per scheduler step with new "
           "questions, plus, with lookup auto, one per question asked within its step).", "lookup_batches"),
    CounterSpec("lookups_skipped", "Questions the lookup thread did not send to the store (or did not finish asking), "
                "by reason: late (past lookup_timeout_s when the thread came to them: answered as misses), unwanted "
                "(every request asking it had ended).",
                {"late": "lookups_skipped_late", "unwanted": "lookups_skipped_unwanted"}, label="reason"),
    _plain("lookups_answered_in_step", "Lookups answered within the scheduler call that first asked them (lookup auto "
           "waiting within the step's budget): requests admitted without waiting a step.", "lookups_answered_in_step"),
    _plain("lookup_wait_seconds", "Seconds the scheduler waited for lookup answers within its steps (lookup auto; at "
           "most the step's budget per step).", "lookup_wait_s"),
    CounterSpec("lookup_steps", "Scheduler steps with new lookups, by how lookup auto answered them: inline (waited "
                "for within the step's budget) or thread (on the lookup thread, the next step). The rate by mode "
                "shows the current choice.", {"inline": "lookup_steps_inline", "thread": "lookup_steps_thread"},
                label="mode"),
    CounterSpec("lookup_mode_switches", "Times lookup auto switched, by the mode it switched to: inline (a lookup "
                "costs the store at most half the step's budget) or thread (more than the budget).",
                {"inline": "lookup_mode_switches_inline", "thread": "lookup_mode_switches_thread"}, label="to"),
    _plain("lookup_batch_requests", "Requests those batches asked about (divided by lookup_batches: the batch size).",
           "lookup_batch_requests"),
    _plain("lookups_shared", "Lookups that joined another request's question about the same prefix (asked once).",
           "lookups_shared"),
    _plain("lookup_retries", "Scheduler steps a request waited for its lookup's answer (asked again the next step).",
           "lookup_retries"),
    _plain("lookups_waiting_for_inflight_load", "Scheduler steps a request waited because a load of the same objects "
           "was still in flight (asked again once it has an outcome).", "lookups_waiting_for_inflight_load"),
    CounterSpec("requests_not_cached", "Requests the store neither served nor saved, by reason: uncacheable (prompt "
                "embeddings; once per request), before_cache_identity (an fp8 cache's scales not yet known from the "
                "workers; once per lookup), adapter_unreadable (a LoRA adapter no worker reported loading, whose "
                "files cannot be read, or one whose files changed while a worker loaded it; once per request).",
                {"uncacheable": "uncacheable_requests", "before_cache_identity": "requests_before_cache_identity",
                 "adapter_unreadable": "adapter_unreadable_requests"},
                label="reason"),
    _plain("blocks_evicted_after_load_failure", "vLLM blocks evicted from its local prefix cache because they held KV "
           "that failed to load, or KV computed over it.", "blocks_evicted_after_load_failure"),
    _plain("save_failures", "Saves whose encode or put failed.", "save_failures"),
    _plain("saves_held_for_load_outcome", "Saves computed after a load, held unwritten until every worker's outcome "
           "of that load was known (tensor or pipeline parallelism).", "saves_held_for_load_outcome"),
    CounterSpec("saves_dropped", "Chunk saves not done, by reason: queue_full, store_down, after_load_failure, "
                "after_load_failure_elsewhere, load_unsettled, incomplete, window_freed and adapter_weights (the LoRA "
                "weights the worker runs were not read from the files the key names) are lost (a later miss); "
                "deferred_store_down waits for the store, deduplicated is being saved by another request, "
                "already_stored is in the store already (the chunk holding a replayed prompt's last token), lossy_kv "
                "rests on lossy KV under precision auto (never stored as the lossless ground truth).",
                {"queue_full": "saves_dropped", "store_down": "saves_dropped_store_down",
                 "window_freed": "saves_dropped_window_freed",
                 "deferred_store_down": "saves_deferred_store_down",
                 "after_load_failure": "saves_skipped_after_load_failure",
                 "after_load_failure_elsewhere": "saves_dropped_after_load_failure_elsewhere",
                 "load_unsettled": "saves_dropped_load_unsettled",
                 "adapter_weights": "saves_skipped_adapter_weights",
                 "incomplete": "saves_incomplete", "deduplicated": "saves_deduplicated",
                 "already_stored": "saves_already_stored", "lossy_kv": "saves_skipped_lossy_kv"},
                label="reason"),
    CounterSpec("store_down", "Times the store went down (up -> down transitions), by the side that saw it.",
                {"scheduler": "store_down_scheduler", "worker": "store_down_worker"}, label="side"),
    _plain("samples_dropped", "Histogram samples dropped to keep one step's report bounded.", "samples_dropped"),
    CounterSpec("tier_reads", "Objects read through a cache+ store, by the tier that had them (near, far).",
                {"near": "tier_near_hits", "far": "tier_far_reads"}, label="tier"),
    CounterSpec("tier_read_bytes", "Bytes read through a cache+ store, by the tier they came from (near, far).",
                {"near": "tier_near_read_bytes", "far": "tier_far_read_bytes"}, label="tier"),
    _plain("tier_far_lookups", "Keys a cache+ store's lookups asked the far store about (the near tier lacked them).",
           "tier_far_lookups"),
    _plain("tier_near_evictions", "Objects a cache+ store's near tier evicted to stay within near_bytes.",
           "tier_near_evictions"),
    _plain("tier_near_damaged", "Damaged near copies dropped (and read again from the far store).", "tier_near_damaged"),
    CounterSpec("tier_far_writes", "Objects a cache+ store wrote to its far store in the background, by outcome "
                "(failed: the near copy was dropped too).",
                {"ok": "tier_far_writes", "failed": "tier_far_write_failures"}, label="outcome"),
    _plain("tier_far_write_bytes", "Bytes a cache+ store wrote to its far store in the background.",
           "tier_far_write_bytes"),
    _plain("tier_far_queue_waits", "Saves that waited for room in a cache+ store's far-write queue (far_queue_bytes).",
           "tier_far_queue_waits"),
    CounterSpec("tier_near_fills", "Far reads a cache+ store copied into its near tier, by outcome (failed: too large for "
                "near_bytes, or the write failed; read from the far store again next time).",
                {"ok": "tier_near_fills", "failed": "tier_near_fill_failures"}, label="outcome"),
    _plain("tier_near_write_failures", "Saves a cache+ store failed to write to its near tier (still written to the far "
           "store).", "tier_near_write_failures"),
    _plain("prefetched_bytes", "Bytes of stored objects fetched ahead of their load (prefetch_bytes), while the "
           "request waited.", "prefetched_bytes"),
    _plain("prefetch_used_bytes", "Of those, bytes a load took instead of asking the store.", "prefetch_used_bytes"),
    _plain("prefetch_wasted_bytes", "Of those, bytes dropped untaken (the request ended, was preempted, or its load "
           "did not take them).", "prefetch_wasted_bytes"),
    _plain("prefetch_skipped_objects", "Objects not fetched ahead for want of room in prefetch_bytes (fetched at load "
           "time).", "prefetch_skipped_objects"),
    CounterSpec("precision_reads", "Stored objects loaded, by what they hold: lossless, or a lossy level (LOSSY: NOT "
                "BIT-EXACT; under precision auto, the variant reads).", _by_precision("precision_reads_"),
                label="precision"),
    _plain("precision_variant_chunks", "Chunks of loads planned to read the lossy variant first (precision auto: the "
           "measured link would not bring their lossless objects within the request's load budget).",
           "precision_variant_chunks_planned"),
    _plain("precision_fallbacks", "Objects of a lossy variant that were missing or failed, read from their lossless "
           "object instead (precision auto; no recompute).", "precision_fallbacks"),
    CounterSpec("precision_saved_objects", "Objects stored, by what they hold (lossless, or a lossy level; precision "
                "auto stores both).", _by_precision("precision_saves_"), label="precision"),
    CounterSpec("precision_saved_bytes", "Bytes stored, by what the objects hold: under precision auto, the lossy "
                "variant's share is what it costs the store.", _by_precision("precision_saved_bytes_"),
                label="precision"),
    CounterSpec("precision_encode_seconds", "Thread-seconds the save threads spent encoding, by what the objects hold "
                "(a lossy level's includes reading the chunk as canonical KV): what a variant costs the saver.",
                _by_precision("precision_encode_s_"), label="precision"),
    _plain("precision_nonfinite_chunks", "Chunks holding NaN or inf, which no quantisation step represents: stored "
           "lossless only (a lossy precision).", "precision_nonfinite_chunks"),
    _plain("lossy_blocks_evicted", "vLLM blocks holding lossy KV (a lossy load's, or computed over one) evicted from "
           "its prefix cache before a request demanding lossless took them as a local hit.", "lossy_blocks_evicted"),
    CounterSpec("kv_events_blocks", "Blocks named in the store's KV cache events, by event type: stored (a save landed "
                "on every rank), removed (a load of them failed, so this instance stops offering them).",
                {"stored": "kv_events_stored_blocks", "removed": "kv_events_removed_blocks"}, label="type"),
)

#: Stats keys counted but deliberately not exported, and why (a test holds every counted key to one or the other).
NOT_EXPORTED: dict[str, str] = {
    "load_failures": "load_failures_total summed over its kind label",
    "fetch_s": "the sum of the fetch_seconds histogram",
    "fetch_batches": "the count of the fetch_seconds histogram",
    "decode_s": "the sum of the decode_seconds histogram",
    "scatter_s": "the sum of the scatter_seconds histogram",
    "upgraded_bytes_before": "upgraded_bytes_saved is before minus after",
    "upgraded_bytes_after": "upgraded_bytes_saved is before minus after",
    "tier_near_misses": "each is a far read (tier_reads with tier far)",
}


@dataclasses.dataclass(frozen=True)
class HistogramSpec:
    name: str
    doc: str
    sample: str
    buckets: tuple[float, ...]


_OBJECT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HISTOGRAMS: tuple[HistogramSpec, ...] = (
    HistogramSpec("lookup_round_trip_seconds", "Seconds the store took to answer one batch of lookups on the lookup "
                  "thread (one existence check; with block_hits one or two more calls), and the start-up probe's "
                  "empty checks: what lookup auto weighs against the step's budget.", "lookup_s",
                  (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)),
    HistogramSpec("load_seconds", "Wall time of one request's load, from submit to its last object in place.",
                  "load_s", (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)),
    HistogramSpec("fetch_seconds", "Seconds of one store round trip of the load path (one batched get of up to 8 MiB of raw KV).", "fetch_s", _OBJECT_BUCKETS),
    HistogramSpec("decode_seconds", "Seconds to check and decode one stored object.", "decode_s", _OBJECT_BUCKETS),
    HistogramSpec("scatter_seconds", "Seconds to write one decoded object into paged memory.", "scatter_s",
                  _OBJECT_BUCKETS),
)


def exported_names() -> set[str]:
    """Every series name on /metrics (counters end in _total; histograms in _bucket, _sum and _count)."""
    names = {f"{PREFIX}{c.name}_total" for c in COUNTERS}
    for h in HISTOGRAMS:
        names |= {f"{PREFIX}{h.name}_{part}" for part in ("bucket", "sum", "count")}
    return names


class KVCodecPromMetrics(KVConnectorPromMetrics):
    """Registers the tables above with vLLM's metric classes and labels; adds each step's data to them."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.chunk_size = _chunk_size(vllm_config)
        self._counters: dict[tuple[str, str], dict[int, Any]] = {}  # (spec name, label value) -> engine -> child
        for spec in COUNTERS:
            names = labelnames + [spec.label] if spec.label else labelnames
            metric = self._counter_cls(name=PREFIX + spec.name, documentation=spec.doc, labelnames=names)
            for value in spec.keys:
                per_engine = {i: v + [value] if spec.label else v for i, v in per_engine_labelvalues.items()}
                self._counters[(spec.name, value)] = create_metric_per_engine(metric, per_engine)
        self._histograms: dict[str, dict[int, Any]] = {}
        for h in HISTOGRAMS:
            metric = self._histogram_cls(name=PREFIX + h.name, documentation=h.doc, buckets=list(h.buckets),
                                         labelnames=labelnames)
            self._histograms[h.sample] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for spec in COUNTERS:
            for value, key in spec.keys.items():
                amount = data.get(key, 0) * (self.chunk_size if spec.scale == "chunk" else 1)
                if amount > 0:
                    self._counters[(spec.name, value)][engine_idx].inc(amount)
        for sample, values in data.get(SAMPLES, {}).items():
            histogram = self._histograms.get(sample)
            if histogram is not None:
                for v in values:
                    histogram[engine_idx].observe(v)


def _chunk_size(vllm_config: "VllmConfig") -> int:
    from vllm_kvcodec.connector.config import ConnectorConfig

    transfer = vllm_config.kv_transfer_config
    return ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config if transfer else None).chunk_size


__all__ = ["COUNTERS", "HISTOGRAMS", "NOT_EXPORTED", "KVCodecPromMetrics", "exported_names"]
