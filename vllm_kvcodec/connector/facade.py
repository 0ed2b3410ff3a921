"""KVCodecConnector: vLLM's entry point, a thin facade over the scheduler and worker halves.

Use it with (the package's vLLM plug-in registers the name; ``"kv_connector_module_path":
"vllm_kvcodec.connector"`` works as well)::

    --kv-transfer-config '{"kv_connector": "KVCodecConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0"}}'

Every call is handed to the half that owns it (the pattern of vLLM's
OffloadingConnector); the halves share only :class:`~.metadata.KVCodecMetadata`.
It implements ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on:
plans carry block ids per KV cache group (see cache_groups.py for what is
covered, and the start-up refusal of the rest).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_kvcodec.connector.cache_groups import cache_groups_for, load_mode
from vllm_kvcodec.connector.cache_identity import check_uniform_cache_dtype
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.connector.engine_namespace import build_namespace
from vllm_kvcodec.connector.parallel_ranks import loading_workers, pp_rank, saving_workers, tp_rank
from vllm_kvcodec.connector.kv_events import store_events_for
from vllm_kvcodec.connector.metadata import KVCodecMetadata, KVCodecWorkerReport
from vllm_kvcodec.connector.precisions import resolve_precision
from vllm_kvcodec.connector.scheduler_half import SchedulerHalf
from vllm_kvcodec.connector.transfer_stats import KVCodecTransferStats
from vllm_kvcodec.connector.vllm_logging import follow_vllm_logging, refusal_logged
from vllm_kvcodec.stats import StoreTierCounters, summarize
from vllm_kvcodec.connector.worker_half import WorkerHalf

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvcodec")
_LIVE: "weakref.WeakSet[KVCodecConnector]" = weakref.WeakSet()
_CREATED = itertools.count()


def live_connectors() -> list["KVCodecConnector"]:
    """Connectors alive in this process, oldest first (tests and the demo read their stats)."""
    return sorted(_LIVE, key=lambda c: c.created)


class KVCodecConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        follow_vllm_logging()  # before the first line is logged; also without the plug-in (module path)
        with refusal_logged():
            self._set_up(vllm_config, role, kv_cache_config)
        self.created = next(_CREATED)
        self._last_log = time.monotonic()
        self._outages_reported = 0
        self._tier_counters: StoreTierCounters | None = None  # a cache+ store's near/far counters (set on first stats)
        _LIVE.add(self)

    def _set_up(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None") -> None:
        """Check the settings against the engine, then build this role's half."""
        transfer = vllm_config.kv_transfer_config
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        check_uniform_cache_dtype(vllm_config.cache_config)
        # A model the connector cannot serve is refused by name before any chunk_size arithmetic: hybrid models
        # raise vLLM's block size (256 for Qwen3-Next on AVX-512 hosts), and "chunk_size must be a multiple of
        # block_size" would send its user to tune a setting that cannot help.
        cache_groups = cache_groups_for(kv_cache_config, block_size, config.chunk_size)
        self.config = config.for_engine(transfer.kv_role, block_size, cache_groups.hit_alignment,
                                        alignment_from=cache_groups.alignment_source)
        self.config = self.config.model_copy(update={"load_mode": load_mode(self.config, cache_groups)})
        namespace = build_namespace(vllm_config, self.config, cache_groups, kv_cache_config)
        self.config = resolve_precision(self.config, namespace.dtype, namespace.num_layers,
                                        bool(getattr(vllm_config.model_config, "use_mla", False)))
        groups = namespace.layer_groups()
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            apply_load_failure_policy(transfer, self.config)  # vLLM reads it right after creating this connector
            self.scheduler = SchedulerHalf(self.config, namespace, len(groups), namespace.tp_size, cache_groups,
                                           loaders=loading_workers(vllm_config))
            self.scheduler.events = store_events_for(vllm_config, self.config, kv_cache_config, cache_groups.block_sizes,
                                                     saving_workers(namespace), self.scheduler.stats)
        else:
            first_group, stage_groups = namespace.stage_groups(pp_rank())
            self.worker = WorkerHalf(vllm_config, self.config, namespace, stage_groups, tp_rank(), cache_groups,
                                     first_group=first_group, loaders=loading_workers(vllm_config))

    # ---- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._w.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._w.save_kv_layer(layer_name, kv_layer, self._meta())

    def wait_for_save(self) -> None:
        self._w.wait_for_save(self._meta() if self.has_connector_metadata() else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KVCodecMetadata) and meta.idle
        return self._w.get_transfer_results(finished_req_ids, idle)  # failed_recving: several KV cache groups

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.get_block_ids_with_load_errors()

    def get_handshake_metadata(self) -> Any:
        """The worker's KV cache identity (fp8 scales), for the scheduler half: see cache_identity.py."""
        return self._w.handshake()

    def build_connector_worker_meta(self) -> KVCodecWorkerReport | None:
        return self._w.build_connector_worker_meta()

    def get_kv_connector_stats(self) -> KVCodecTransferStats | None:
        half = self.worker or self.scheduler  # vLLM asks both sides
        if half is None:
            return None
        self._count_store_outages(half)
        self._tier_counters = self._tier_counters or StoreTierCounters(half.store)
        self._tier_counters.add_growth(half.stats)
        self._maybe_log(half)
        data = half.stats.take_interval()
        return KVCodecTransferStats(data=data) if data else None

    def _maybe_log(self, half: WorkerHalf | SchedulerHalf) -> None:
        """One INFO line of totals every ``log_interval_s`` (vLLM only logs its stats with log_stats on)."""
        now = time.monotonic()
        interval = self.config.log_interval_s
        if interval and now - self._last_log >= interval:
            self._last_log = now
            totals = summarize(half.stats.totals())
            if totals:
                logger.info("kvcodec %s: %s", self.role.name.lower(), ", ".join(f"{k}={v}" for k, v in totals.items()))

    def _count_store_outages(self, half: WorkerHalf | SchedulerHalf) -> None:
        """Each up -> down transition of this side's store, once (``vllm:kvcodec_store_down_total``)."""
        outages = getattr(half.store, "outages", 0)
        if outages > self._outages_reported:
            half.stats.add(**{f"store_down_{self.role.name.lower()}": outages - self._outages_reported})
            self._outages_reported = outages

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCodecTransferStats | None:
        return KVCodecTransferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> "KVConnectorPromMetrics":
        """The connector's series on vLLM's /metrics (vLLM calls this in its front-end process)."""
        from vllm_kvcodec.connector.prom_metrics import KVCodecPromMetrics

        return KVCodecPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCodecMetadata:
        return self._s.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their chunks out of paged memory within the step: nothing holds blocks, but the finishing tail
        # (block_hits), gathered in the next step while vLLM holds the blocks for it (reported as finished sending).
        return self._s.request_finished(request), None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid-manager end of a request (SupportsHMA): the same, for every KV cache group at once."""
        return self.request_finished(request, [])

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s.bind_kv_cache_manager(kv_cache_manager)  # to evict blocks whose load failed

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._s.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: forget what this instance knows of the store (the
        chunks it saved, the loads that failed), so that it looks chunks up and saves them as a fresh instance
        would. The store itself is shared with other instances: it is left as it is."""
        self._s.forget_store()
        return True

    def take_events(self) -> "Iterable[KVCacheEvent]":
        """The store's KV cache events since the last step (BlockStored / BlockRemoved, see kv_events.py):
        vLLM's scheduler publishes them with its own when --kv-events-config enables them."""
        return self.scheduler.events.take() if self.scheduler is not None else ()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._s.adopt_handshake(metadata)  # before the first request: keys of fp8 caches need the scales

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's handshake, keyed by (pipeline stage, TP rank): with pipeline parallelism each stage is
        its own set of workers, and all of them must report the namespace the scheduler keys chunks in."""
        self._s.adopt_handshake({i: h for i, h in enumerate(metadata.values())})

    def has_pending_push_work(self) -> bool:
        """Saves or upgrades in flight on the workers: vLLM steps an idle engine for them, so their counters reach
        /metrics as they land (for at most shutdown_flush_s; see background_work.py)."""
        return self.scheduler is not None and self.scheduler.keep_stepping.wanted()

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a producer handing KV to a consumer: a save that does not happen is a future miss."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM >= 0.33 sleep mode drops and remaps the KV caches; the worker keeps per-layer layouts,
        GPU pointer tables and loads in flight into those tensors, and has not been verified across a
        remap, so it says no rather than write into memory that moved."""
        return False

    # ---- both -----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Totals since start (hits, tokens and bytes moved, stage times, failures)."""
        half = self.worker or self.scheduler
        return summarize(half.stats.totals()) if half is not None else {}

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait for background work: loads abandoned at their deadline still reading, saves, then upgrades
        (tests, benchmarks, the demo: counters read after it include all of them)."""
        if self.worker is None:
            return True
        fetcher = self.worker.fetcher
        if not (fetcher is None or fetcher.settle(timeout)):
            return False
        if self.worker.saver is None:
            return True
        if self.worker.save_gather is not None:
            self.worker.save_gather.flush()  # chunks still on their way to the saver (GPU hand-off)
        saved = self.worker.saver.flush(timeout)
        upgrader = self.worker.upgrader
        return saved and (upgrader is None or upgrader.flush(timeout))

    def shutdown(self) -> None:
        for half in (self.worker, self.scheduler):
            if half is not None:
                half.shutdown()

    @property
    def _w(self) -> WorkerHalf:
        assert self.worker is not None, "worker-side call on the scheduler connector"
        return self.worker

    @property
    def _s(self) -> SchedulerHalf:
        assert self.scheduler is not None, "scheduler-side call on the worker connector"
        return self.scheduler

    def _meta(self) -> KVCodecMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCodecMetadata)
        return meta


def apply_load_failure_policy(transfer: "KVTransferConfig", config: ConnectorConfig) -> None:
    """Choose vLLM's ``kv_load_failure_policy``: the user's word where it can be told, else ``recompute``.

    For a cache, a load that fails is a miss to recompute; vLLM's default,
    ``fail``, would fail the request instead. vLLM's config object cannot tell
    an explicit ``fail`` from that default, so ``on_load_failure`` in
    ``kv_connector_extra_config`` is the explicit way to ask for it; an
    explicit ``recompute`` (not vLLM's default) is kept as set.
    """
    wanted = config.on_load_failure
    current = transfer.kv_load_failure_policy
    if wanted is None:
        wanted = "recompute"
    elif current == "recompute" and wanted == "fail":
        raise ConfigError("kv_load_failure_policy 'recompute' and on_load_failure 'fail' disagree; set one of them")
    if current != wanted:
        logger.info("kvcodec: kv_load_failure_policy %r (was %r): a failed load is %s", wanted, current,
                    "recomputed" if wanted == "recompute" else "an error of its request")
        transfer.kv_load_failure_policy = wanted
