"""Worker half: gathers saved chunks out of paged memory and runs loads into it.

Runs where the KV cache lives. ``save_kv_layer`` copies the slots of each
chunk to save out of one layer as the forward pass goes; ``wait_for_save``
hands the completed chunks to the background saver and returns (it never waits
on encoding or the network). ``start_load_kv`` submits the step's loads to the
fetcher; ``wait_for_layer_load`` waits for one layer only, with a deadline,
after which the load is abandoned and its blocks are reported for recompute.
What became of every load and save goes back to the scheduler half in
``build_connector_worker_meta`` (:class:`~.metadata.KVCodecWorkerReport`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from storage.options import redact_url
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from vllm_kvcodec.save.codec_choice import CodecChooser, probe_link
from vllm_kvcodec.connector.background_work import BackgroundTally
from vllm_kvcodec.connector.cache_groups import CacheGroups, layer_index
from vllm_kvcodec.connector.cache_identity import KVCodecHandshake, is_fp8, scales_digest
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.codecs import policy
from vllm_kvcodec.save.codec_warmup import warm_up
from vllm_kvcodec.load.cores import idle_cores, load_threads
from vllm_kvcodec.load.load_balance import LoadBalance
from vllm_kvcodec.load.prefetch import Prefetcher
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.connector.lora_loads import LoadedAdapters, watch_adapter_loads
from vllm_kvcodec.runtime.malloc import reuse_large_buffers
from vllm_kvcodec.connector.metadata import KVCodecMetadata, KVCodecWorkerReport
from vllm_kvcodec.connector.precisions import Precisions
from vllm_kvcodec.connector.worker_precisions import WorkerPrecisions
from vllm_kvcodec.plans.outcomes import LoadOutcome, SaveOutcome
from vllm_kvcodec.plans.saves import SaveSpec
from vllm_kvcodec.paged import CANONICAL_NAMESPACE, layouts_for, shared_kv_layers
from vllm_kvcodec.paged.objects import object_layout_for
from vllm_kvcodec.save.gather import SaveGather, chunk_nbytes, save_gather_for
from vllm_kvcodec.save.held_saves import HOLD_SLACK_S, HeldSaves
from vllm_kvcodec.save.saver import SaveCounts, Saver
from vllm_kvcodec.save.upgrade import Upgrader
from vllm_kvcodec.stats import ConnectorStats
from vllm_kvcodec.connector.store_access import open_connector_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm_kvcodec")
#: How long an idle step waits for an async load, or for background work to progress (background_work.py): a
#: request arriving meanwhile is scheduled that much later.
IDLE_POLL_S = 0.01
#: Bytes beyond its raw KV an object may hold (header, codec framing): what a prefetch reserves at most.
PREFETCH_SLACK = 4096


class WorkerHalf:
    def __init__(self, vllm_config: "VllmConfig", config: ConnectorConfig, namespace: Namespace, groups: list[range],
                 tp_rank: int, cache_groups: CacheGroups, first_group: int = 0, loaders: int = 1) -> None:
        """``loaders``: the workers that run each load (every TP rank of every stage); with more than one, a save
        computed after a load waits for all their outcomes (save/held_saves.py)."""
        if not ObjectAddresses(namespace, tp_rank, ()).saves:
            # A replicated cache (MLA's latent, TP > 1) is written by rank 0 only: one writer per key; this rank loads.
            config = config.model_copy(update={"save": False})
        self.vllm_config, self.config, self.namespace = vllm_config, config, namespace
        self.groups, self.tp_rank, self.cache_groups = groups, tp_rank, cache_groups
        self.first_group = first_group  # pipeline parallelism: this stage's groups are numbered from it in keys
        self.loaders = loaders
        self.stats = ConnectorStats()
        dtype = DType.parse(namespace.dtype)
        self.objects = object_layout_for(namespace.layout_id)  # what one stored object holds: pages or canonical KV
        self.chooser = CodecChooser(_codec_spec(config.codec, dtype), candidates=policy.auto_candidates(dtype),
                                    decoders=1,  # until register_kv_caches knows the caches' device
                                    behind=policy.behind_codec_for(config.save_codec_when_behind, dtype))
        self.store = open_connector_store(config)
        self.fetcher: Fetcher | None = None
        self.prefetcher: Prefetcher | None = None  # objects of waiting requests' hits, fetched ahead
        self.saver: Saver | None = None
        self._layer_of: dict[str, int] = {}
        self._shared: set[str] = set()  # layers that read another layer's KV: saved and loaded through it
        self._failed_recving: set[str] = set()  # several KV cache groups: failed loads go per request
        self._sent: set[str] = set()  # finished requests whose finishing tail was gathered: vLLM frees their blocks
        self._sync_job: LoadJob | None = None
        self._whole_loads = False  # load_wait may make the prefill wait for whole loads (set with the caches)
        self._load_balance = LoadBalance()  # whether recent sync loads were bound by their fetches or their decode
        self._async_jobs: dict[str, LoadJob] = {}
        self._load_errors: set[int] = set()
        # Per request, the ids of its loads that failed here: its saves planned before the scheduler heard of
        # one of them (SaveSpec.unsettled_loads) are dropped.
        self._load_failures: dict[str, set[int]] = {}
        self._load_outcomes: dict[str, LoadOutcome] = {}
        self._load_ids: dict[str, int] = {}  # request -> the scheduler's id of its load running here (echoed)
        self._save_outcomes: list[SaveOutcome] = []
        self._outcome_lock = threading.Lock()  # save outcomes arrive from the saver's threads
        self.recent_loads: collections.deque = collections.deque(maxlen=64)  # for inspection and tests
        self.save_gather: SaveGather | None = None
        self.upgrader: Upgrader | None = None
        self.precisions: WorkerPrecisions | None = None  # with the caches: each precision's addresses
        self.background = BackgroundTally(self._background_in_flight, self._save_counts)
        # LoRA: which files the adapters this worker runs were read from (lora_loads.py), checked before every
        # load and save of a LoRA request.
        self.adapters: LoadedAdapters | None = None
        if getattr(vllm_config, "lora_config", None) is not None and watch_adapter_loads():
            self.adapters = LoadedAdapters(vllm_config.lora_config)
        self._adapters_warned: set[int] = set()
        reuse_large_buffers()
        warm_up(DType.parse(namespace.dtype).torch_dtype)  # compile codec kernels now, not in the first load

    # ---- set-up ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shared = shared_kv_layers(self.vllm_config, kv_caches)
        self._shared = set(shared)
        own = {name: t for name, t in kv_caches.items() if name not in shared}
        layouts = layouts_for(self.vllm_config, own)
        names = sorted(own, key=layer_index)
        expected = sum(len(g) for g in self.groups)  # this pipeline stage's layers (all of them without PP)
        if len(names) != expected:
            raise ConfigError(f"expected {expected} KV layers, vLLM registered {len(names)}")
        self._check_layouts(names, layouts)
        self._adopt_scales(names)
        self._layer_of = {name: i for i, name in enumerate(names)}
        self._layer_of.update({name: self._layer_of[target] for name, target in shared.items()})
        caches = [own[n] for n in names]
        ordered = [layouts[n] for n in names]
        self.caches, self.layouts = caches, ordered
        self._check_save_room()
        self.layer_cache_groups = [self.cache_groups.of_layer(n) for n in names]
        addresses = ObjectAddresses(self.namespace, self.tp_rank, tuple(self.groups), self.first_group)
        self.addresses = addresses
        cores_all_busy = not caches[0].is_cuda and idle_cores() == 0  # a CPU engine's threads take every core
        self._whole_loads = self.config.load_wait == "whole" or (self.config.load_wait == "auto" and cores_all_busy)
        threads = load_threads(self.config.fetch_threads, self.config.decode_threads, on_device=caches[0].is_cuda,
                               reads_in_memory=self.store.reads_in_memory, whole_loads=self._whole_loads)
        self.chooser.decoders = threads.decode
        if caches[0].is_cuda and self.chooser.auto:  # auto calibrates the decoders this fetcher uses (device, NVDEC)
            from vllm_kvcodec.save.codec_choice import cuda_decode_paths

            self.chooser.decode_paths = cuda_decode_paths(caches[0].device, threads.decode)
        self.chooser.reads_cost_cpu = self.store.reads_in_memory
        self.chooser.decode_takes_prefill_cores = (cores_all_busy and self.config.load_wait != "whole"
                                                   and not self.store.reads_in_memory)
        self.precisions = WorkerPrecisions(Precisions.from_config(self.config), addresses, self.objects, ordered[0],
                                           self.chooser, self.stats)
        self.fetcher = _fetcher_class(caches)(self.store, addresses, caches, ordered, threads.fetch,
                                              self.stats, self.chooser.observe_read,
                                              cache_groups=self.layer_cache_groups, decode_threads=threads.decode,
                                              variants=self.precisions.variants(),
                                              observe_object=self.precisions.observe_load)
        if self.config.prefetches() and not self.store.ranged_reads:  # objects read in place are never taken
            self.prefetcher = Prefetcher(self.store, self.config.prefetch_bytes, self.stats)
            self.fetcher.prefetched = self.prefetcher
        held = HeldSaves(self.config.load_timeout_s + HOLD_SLACK_S) if self.loaders > 1 else None
        self.saver = Saver(self.store, addresses, self.chooser, self.config.save_threads,
                           self.config.max_pending_save_bytes, self.stats, report=self._save_settled,
                           nice=self.config.save_thread_nice, held=held, lossy=self.precisions.lossy,
                           observe_object=self.precisions.observe_save)
        self.save_gather = save_gather_for(caches, ordered, self.saver, self.layer_cache_groups, self.objects)
        self.fetcher.placement.block_reads = self.save_gather.block_reads  # loads wait for reads of their blocks
        if self.config.save and self.config.upgrade_fallback_chunks and self.chooser.behind is not None:
            self.upgrader = Upgrader(self.store, self.chooser, self.saver.idle, self.stats,
                                     ended=self.background.progressed)
            self.fetcher.after_load = self.upgrader.offer
        self.chooser.token_axis = self.objects.token_axis
        probed = self.chooser.auto and self.config.save  # a load-only instance chooses no codec: it writes nothing
        if probed:
            probe_link(self.store, addresses.key(os.urandom(16).hex(), 0), self.chooser)
        self.precisions.probe(self.store, self.chooser, probed)
        logger.info("kvcodec: %d KV layers, %d per stored object (%d KV cache groups: %s), layout %s, store %s, "
                    "codec %s, precision %s, %d fetch / %d decode threads", len(names), len(self.groups[0]),
                    len(self.cache_groups.groups), ", ".join(g.label for g in self.cache_groups.groups),
                    ordered[0].layout_id, redact_url(self.config.store), self.chooser.fixed or "auto",
                    self.precisions.precisions.label(), threads.fetch, threads.decode)

    def _check_save_room(self) -> None:
        """A cap below one chunk would drop every save, silently but for a counter: refuse it at start-up
        (before any thread starts)."""
        chunk = chunk_nbytes(self.layouts, self.config.chunk_size)
        if chunk > self.config.max_pending_save_bytes:
            raise ConfigError(f"max_pending_save_bytes {self.config.max_pending_save_bytes} is below one chunk's KV "
                              f"on this worker ({chunk} bytes for chunk_size {self.config.chunk_size}): no save "
                              f"could ever be queued; raise it to at least {chunk} or lower chunk_size")

    def _check_layouts(self, names: list[str], layouts: dict[str, Any]) -> None:
        """Every layer in the namespace's dtype and one geometry (and canonical, for canonical objects): what one stored object can hold."""
        want = DType.parse(self.namespace.dtype).torch_dtype
        first = layouts[names[0]]
        for name in names:
            a = layouts[name]
            if self.objects.namespace_id == CANONICAL_NAMESPACE and a.key_namespace != CANONICAL_NAMESPACE:
                raise ConfigError(f"layer {name}: layout {a.layout_id} is not canonical; cannot share chunks")
            if a.dtype != want:
                raise ConfigError(f"layer {name}: KV cache holds {a.dtype}, the namespace {self.namespace.dtype}; "
                                  "mixed KV cache dtypes are not supported")
            if (a.num_kv_heads, a.head_size) != (first.num_kv_heads, first.head_size):
                raise ConfigError(f"layer {name}: {a.num_kv_heads} kv heads x {a.head_size} differ from layer "
                                  f"{names[0]}'s {first.num_kv_heads} x {first.head_size}; one stored object holds "
                                  "layers of one geometry")

    def _adopt_scales(self, names: list[str]) -> None:
        """fp8 caches: the layers' scales (loaded with the weights by now) join the namespace."""
        if not is_fp8(self.namespace.dtype):
            return
        ctx = self.vllm_config.compilation_config.static_forward_context
        digest = scales_digest(ctx[name] for name in names)
        self.namespace = dataclasses.replace(self.namespace, kv_scales=digest)
        logger.info("kvcodec: %s KV cache, per-layer scales digest %s", self.namespace.dtype, digest[:12])

    def handshake(self) -> KVCodecHandshake:
        """What the scheduler half needs from this worker before it keys any chunk (vLLM's connector handshake)."""
        return KVCodecHandshake(kv_scales=self.namespace.kv_scales, namespace_digest=self.namespace.digest,
                                read_costs=self.precisions.report() if self.precisions is not None else None)

    # ---- load -----------------------------------------------------------------------
    def start_load_kv(self, meta: KVCodecMetadata) -> None:
        assert self.fetcher is not None and self.saver is not None, "register_kv_caches was not called"
        self.saver.settle_loads(meta.settled_loads)  # saves held for loads now settled on every worker
        timeout = self.config.load_timeout_s
        self.recent_loads.extend(meta.loads)
        if self.prefetcher is not None:
            for ahead in meta.prefetches:
                self.prefetcher.start(ahead.req_id, self._prefetch_objects(ahead.chunk_hashes, ahead.precisions))
        if self.prefetcher is not None and meta.loads:
            chunks = [(c.chunk_hash, c.precisions[0]) for spec in meta.loads for c in spec.chunks]
            self.prefetcher.claim([self._key(h, p, g) for h, p in chunks for g in range(len(self.groups))])
        self._load_ids.update((spec.req_id, spec.load_id) for spec in meta.loads)
        refused = {spec.req_id for spec in meta.loads if not self._runs_adapter(spec.adapter)}
        if refused:
            self.stats.add(loads_refused_adapter_weights=len(refused))
        sync = [s for s in meta.loads if not s.is_async]
        if sync:
            self._sync_job = self.fetcher.submit(sync, timeout, refused)
        for spec in meta.loads:
            if spec.is_async:
                self._async_jobs[spec.req_id] = self.fetcher.submit([spec], timeout, refused)
        if self.prefetcher is not None:
            for req_id in meta.prefetch_done:  # after the loads claimed theirs
                self.prefetcher.give_up(req_id)

    def _prefetch_objects(self, chunk_hashes: list[str], precisions: list[tuple[str, ...]] | None) -> list[tuple[str, int]]:
        """Each chunk's objects of this rank (in the first precision its load will read), with the bytes each may
        hold at most (raw KV plus its header)."""
        first = [p[0] for p in precisions] if precisions else [LOSSLESS] * len(chunk_hashes)
        out = []
        for g, layers in enumerate(self.groups):
            size = len(layers) * self.namespace.chunk_size * self.layouts[layers[0]].token_nbytes() + PREFETCH_SLACK
            out.extend((self._key(h, p, g), size) for h, p in zip(chunk_hashes, first))
        return out

    def _key(self, chunk_hash: str, precision: str, group: int) -> str:
        """This rank's object of ``group`` of a chunk, in ``precision``'s namespace."""
        return self.precisions.addresses[precision].key(chunk_hash, group)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._sync_job
        if job is None:
            return
        layer = self._layer_of.get(layer_name)
        if layer == 0 and self._waits_whole():
            self.stats.add(load_waits_whole=1)
            # Not whole by its deadline: abandoned now, even with layer 0 in place. Left running, its late objects
            # would decode beside the prefill (what waiting whole avoids) and be used or not by how fast the
            # prefill reached their layers: on a loaded host a 1.5 s read under a 1 s timeout went uncounted.
            if not job.wait_all(job.deadline):
                self._time_out(job)
                return
        if layer is None or job.wait_layer(layer, job.deadline):
            return
        self._time_out(job)

    def _time_out(self, job: LoadJob) -> None:
        """Past its deadline: count it and cancel (what is not in place yet is recomputed)."""
        self.stats.add(load_timeouts=1)
        logger.warning("kvcodec: load did not finish within %.1f s; recomputing its blocks", self.config.load_timeout_s)
        job.cancel()

    def _waits_whole(self) -> bool:
        """Whether this step's prefill waits for the whole sync load before its first layer (``load_wait``).

        On a CPU engine whose threads take every core, a load decoding beside
        the prefill takes cores from its OpenMP team, which then waits on its
        slowest thread; waiting lets the load run alone on every core. That
        pays where decode and copies outlast the fetches (:mod:`vllm_kvcodec.load.load_balance`),
        and always where the store's reads are memory copies on this host (a
        local file store), whose every part is CPU work the overlap cannot
        hide: a 4096-token raw replay from the local disk took 1.52x the local
        hit waiting against 1.75x beside the prefill (2 cores).
        Before the first load, auto judges by the codec this instance saves with.
        """
        if not self._whole_loads:
            return False
        if self.config.load_wait == "whole" or self.store.reads_in_memory:
            return True
        cpu_bound = self._load_balance.cpu_bound
        if cpu_bound is None:
            return self.chooser.current_id not in (None, "raw")
        return cpu_bound

    def _finish_sync_load(self) -> None:
        """The step's sync loads end with its forward pass; both of vLLM's end-of-step calls need their outcome
        (``wait_for_save``: which saves rest on good KV; ``get_block_ids_with_load_errors``: what to report)."""
        job, self._sync_job = self._sync_job, None
        if job is not None:
            job.done.wait(max(0.0, job.deadline - time.monotonic()))
            if (fetcher := self.fetcher) is not None:
                self._load_balance.observe(job.fetch_s, fetcher.fetch_threads, job.cpu_s, fetcher.cpu_threads)
            self._settle(job)

    def _settle(self, job: LoadJob) -> None:
        """A job that is done, or past its deadline (then cancelled): collect its failed blocks and outcomes."""
        if not job.done.is_set():
            self.stats.add(load_timeouts=1)
            job.cancel()
        job.settle()
        if not self.cache_groups.multi:
            self._load_errors |= job.failed_blocks  # one group: vLLM recomputes from the first failed block
        for req_id, outcome in job.outcomes().items():
            load_id = self._load_ids.pop(req_id, 0)
            if outcome.failed:
                self._load_failures.setdefault(req_id, set()).add(load_id)
                if self.cache_groups.multi:
                    self._failed_recving.add(req_id)  # several groups: vLLM takes failures per request only
            self._load_outcomes[req_id] = dataclasses.replace(outcome, load_id=load_id)

    def _abandon(self, job: LoadJob) -> None:
        """The request ended while its load ran: stop writing; what was not loaded did not *fail*."""
        job.cancel()
        job.settle()
        for req_id, outcome in job.outcomes().items():
            self._load_outcomes[req_id] = LoadOutcome(outcome.loaded, [], self._load_ids.pop(req_id, 0))
        self.stats.add(loads_abandoned=1)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set()
        for req_id, job in list(self._async_jobs.items()):
            if req_id in finished_req_ids and not job.done.is_set():
                self._abandon(job)  # vLLM holds its blocks until this load reports: free them now
            elif job.done.is_set() or time.monotonic() > job.deadline:
                self._settle(job)
            else:
                continue
            done.add(req_id)
            del self._async_jobs[req_id]
        for req_id in finished_req_ids:
            self._load_failures.pop(req_id, None)
        sending, self._sent = self._sent, set()
        return sending or None, done or None

    def get_transfer_results(self, finished_req_ids: set[str], idle: bool = False) -> KVConnectorTransferResults:
        """Finished async loads, and (several KV cache groups) which of them failed: vLLM recomputes those requests.

        In a step with nothing scheduled (``idle``) this waits up to
        ``IDLE_POLL_S`` for a pending load to finish, or for background work
        to progress, GIL released, instead of letting vLLM's loop spin
        against the fetch or save threads.
        """
        self.background.step(idle)
        if idle and self._async_jobs:
            self._await_any_async_load(IDLE_POLL_S)
        elif idle:
            self.background.wait(IDLE_POLL_S)  # vLLM steps for saves and upgrades in flight: poll, do not spin
        sending, done = self.get_finished(finished_req_ids)
        done = done or set()
        failed, self._failed_recving = self._failed_recving & done, self._failed_recving - done
        return KVConnectorTransferResults(finished_sending=sending or set(), finished_recving=done, failed_recving=failed)

    def _await_any_async_load(self, timeout_s: float) -> None:
        jobs = list(self._async_jobs.values())
        if jobs and not any(job.done.is_set() for job in jobs):
            jobs[0].done.wait(timeout_s)  # the oldest: the fetch pool serves loads in submission order

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_sync_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVCodecWorkerReport | None:
        """What became of loads and saves since the last step, and the LoRA adapters loaded (None when nothing)."""
        with self._outcome_lock:
            saves, self._save_outcomes = self._save_outcomes, []
        loads, self._load_outcomes = self._load_outcomes, {}
        background = self.background.report()
        adapters = self.adapters.new_loads() if self.adapters is not None else {}
        costs = self.precisions.report() if self.precisions is not None else None
        if not loads and not saves and background is None and not adapters and not costs:
            return None
        return KVCodecWorkerReport(loads, saves, None if self.saver is None else self.saver.room(), background,
                                   adapters, costs)

    def _save_settled(self, outcome: SaveOutcome) -> None:
        with self._outcome_lock:
            self._save_outcomes.append(outcome)
        self.background.progressed()

    def _background_in_flight(self) -> int:
        """Saves and upgrades queued or running: what vLLM keeps an idle engine stepping for."""
        saves = 0 if self.saver is None else self.saver.in_flight()
        return saves + (0 if self.upgrader is None else self.upgrader.in_flight())

    def _save_counts(self) -> SaveCounts:
        return SaveCounts() if self.saver is None else self.saver.counts()

    # ---- save -----------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: KVCodecMetadata) -> None:
        if not meta.saves or self.save_gather is None or not self.config.save:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None or layer_name in self._shared:
            return  # a layer reading another's KV: saved through its target
        self.save_gather.gather_layer(layer, kv_layer, meta.saves)

    def wait_for_save(self, meta: KVCodecMetadata | None) -> None:
        self._finish_sync_load()  # a save of this step is only good if this step's loads were
        if meta is not None and meta.finishing:
            self._sent.update(meta.finishing)  # gathered below (or given up): vLLM may free their blocks after this step
        if meta is None or not meta.saves or self.save_gather is None or not self.config.save:
            return  # nothing planned, or this rank writes nothing (the scheduler plans for every rank at once)
        if meta.finishing:
            self.save_gather.gather_unseen(meta.saves)  # a step without a forward has called no save_kv_layer
        for spec, reason in self.save_gather.end_step(meta.saves, self._good_to_save):
            if reason == "incomplete":
                self.stats.add(saves_incomplete=1)
            needs = self.save_gather.chunk_nbytes(len(spec.group_slots[0])) if reason == "no room" else 0
            self._save_settled(SaveOutcome(spec.req_id, spec.chunk_hash, landed=False, needs_room=needs,
                                           load_failed=reason == "load failed"))  # planned again

    def _good_to_save(self, spec: SaveSpec) -> bool:
        """Whether a gathered chunk's KV is what its key names: its adapter's weights, over loads that did not fail."""
        if not self._runs_adapter(spec.adapter):
            self.stats.add(saves_skipped_adapter_weights=1)
            return False
        return self._computed_over_good_kv(spec)

    def _runs_adapter(self, adapter: tuple[int, str] | None) -> bool:
        """Whether the KV of a plan's keys is this worker's: no LoRA adapter, or the weights registered for its id
        now were read from the files its keys name (not so after a rewrite in place, or a reload of new files)."""
        if adapter is None:
            return True
        running = self.adapters.running(adapter[0]) if self.adapters is not None else ""
        if running == adapter[1]:
            return True
        if running is not None and adapter[0] not in self._adapters_warned:  # None: not loaded yet, or evicted
            self._adapters_warned.add(adapter[0])
            logger.warning("kvcodec: LoRA adapter id %d: the weights this worker runs were not read from the files "
                           "its requests are keyed by (rewritten in place, or while it loaded them); their loads and "
                           "saves are refused until the scheduler keys them by what was loaded", adapter[0])
        return False

    def _computed_over_good_kv(self, spec: SaveSpec) -> bool:
        """False when a load of the request failed here that the scheduler had not heard of when it planned the
        save: the chunk may rest on missing KV. (Another worker's failure of it is heard of later: the Saver holds
        the save until then, see save/held_saves.py.)"""
        if not self._load_failures.get(spec.req_id, set()).isdisjoint(spec.unsettled_loads):
            self.stats.add(saves_skipped_after_load_failure=1)
            return False
        return True

    def shutdown(self) -> None:
        if self.upgrader is not None:
            self.upgrader.shutdown()
        if self.save_gather is not None:
            self.save_gather.shutdown()
        if self.saver is not None:  # queued saves get shutdown_flush_s from the engine's last computing step
            self.saver.shutdown(self.background.window_left(self.config.shutdown_flush_s), self.background.idle_mark)
        if self.fetcher is not None:
            self.fetcher.shutdown()
        if self.prefetcher is not None:
            self.prefetcher.shutdown()
        self.store.close()


def _codec_spec(configured: Any, dtype: DType) -> Any:
    """``auto``, or the codec the policy picks for the model's dtype (a named one that cannot hold it fails here, at start-up)."""
    if configured == policy.AUTO:
        return configured
    return policy.codec_for(configured, dtype, unsupported="error")[0]


def _fetcher_class(caches: list[torch.Tensor]) -> type:
    """KV on a CUDA device loads through streams and Triton kernels (load/cuda_placement.py); elsewhere through threads."""
    if caches[0].is_cuda:
        from vllm_kvcodec.load.cuda_placement import CudaFetcher

        return CudaFetcher
    return Fetcher
