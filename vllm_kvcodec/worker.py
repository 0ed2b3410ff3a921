"""Worker half: gathers saved chunks out of paged memory and runs loads into it.

Runs where the KV cache lives. ``save_kv_layer`` copies the slots of each
chunk to save out of one layer as the forward pass goes; ``wait_for_save``
hands the completed chunks to the background saver and returns (it never waits
on encoding or the network). ``start_load_kv`` submits the step's loads to the
fetcher; ``wait_for_layer_load`` waits for one layer only, with a deadline,
after which the load is abandoned and its blocks are reported for recompute.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import time
from typing import TYPE_CHECKING

import torch

from storage.options import redact_url
from vllm_kvcodec.codec_choice import CodecChooser
from vllm_kvcodec.config import ConnectorConfig
from vllm_kvcodec.dtypes import DType
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.format import default_codec_for
from vllm_kvcodec.fetcher import Fetcher
from vllm_kvcodec.keys import Namespace, ObjectAddresses
from vllm_kvcodec.load_job import LoadJob
from vllm_kvcodec.malloc_tuning import reuse_large_buffers
from vllm_kvcodec.metadata import KVCodecMetadata
from vllm_kvcodec.paged import CANONICAL_NAMESPACE, adapters_for, shared_kv_layers
from vllm_kvcodec.saver import Saver
from vllm_kvcodec.stats import ConnectorStats
from vllm_kvcodec.store_access import open_connector_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm_kvcodec")


def layer_index(name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12 (the order KV is stored in)."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise ConfigError(f"cannot tell the layer index of KV cache {name!r}")
    return int(numbers[0])


class WorkerHalf:
    def __init__(self, vllm_config: "VllmConfig", config: ConnectorConfig, namespace: Namespace, groups: list[range], tp_rank: int) -> None:
        self.vllm_config, self.config, self.namespace = vllm_config, config, namespace
        self.groups, self.tp_rank = groups, tp_rank
        self.stats = ConnectorStats()
        codec = config.codec if config.codec is not None else default_codec_for(DType.parse(namespace.dtype))
        self.chooser = CodecChooser(codec, decoders=min(config.fetch_threads, os.cpu_count() or 1))
        if self.chooser.fixed is not None:
            self.chooser.fixed.check_dtype(DType.parse(namespace.dtype))  # fail at start-up, not on every save
        self.store = open_connector_store(config)
        self.fetcher: Fetcher | None = None
        self.saver: Saver | None = None
        self._layer_of: dict[str, int] = {}
        self._sync_job: LoadJob | None = None
        self._failed_reqs: set[str] = set()  # this step's requests whose sync load failed
        self._async_jobs: dict[str, LoadJob] = {}
        self._load_errors: set[int] = set()
        self.recent_loads: collections.deque = collections.deque(maxlen=64)  # for inspection and tests
        self._gathered: dict[int, torch.Tensor] = {}  # save index -> [layers, 2, chunk, heads, dim]
        self._gathered_layers: dict[int, int] = {}
        self._admitted: dict[int, bool] = {}  # this step's save index -> fits under the saver's cap
        self._admitted_bytes = 0
        self.gpu_save = None  # CudaSaveGather when the KV caches are on a CUDA device
        reuse_large_buffers()

    # ---- set-up ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shared = shared_kv_layers(kv_caches)
        own = {name: t for name, t in kv_caches.items() if name not in shared}
        adapters = adapters_for(self.vllm_config, own)
        names = sorted(own, key=layer_index)
        if len(names) != self.namespace.num_layers:
            raise ConfigError(f"expected {self.namespace.num_layers} KV layers, vLLM registered {len(names)}")
        for name in names:
            if adapters[name].key_namespace != CANONICAL_NAMESPACE:
                raise ConfigError(f"layer {name}: layout {adapters[name].layout_id} is not canonical; cannot share chunks")
        self._layer_of = {name: i for i, name in enumerate(names)}
        self._layer_of.update({name: self._layer_of[target] for name, target in shared.items()})
        caches = [own[n] for n in names]
        ordered = [adapters[n] for n in names]
        self.caches, self.adapters = caches, ordered
        addresses = ObjectAddresses(self.namespace, self.tp_rank, tuple(self.groups))
        self.fetcher = _fetcher_class(caches)(self.store, addresses, caches, ordered,
                                              self.config.fetch_threads, self.stats, self.chooser.observe_transfer)
        self.saver = Saver(self.store, addresses, self.chooser,
                           self.config.save_threads, self.config.max_pending_save_bytes, self.stats,
                           store_down=lambda: self.store.is_down)
        if caches[0].is_cuda:
            self.gpu_save = self.fetcher.save_gather(self.saver)
        logger.info("kvcodec: %d KV layers in %d groups, layout %s, store %s, codec %s",
                    len(names), len(self.groups), ordered[0].layout_id, redact_url(self.config.store), self.chooser.fixed or "auto")

    # ---- load -----------------------------------------------------------------------
    def start_load_kv(self, meta: KVCodecMetadata) -> None:
        assert self.fetcher is not None, "register_kv_caches was not called"
        timeout = self.config.load_timeout_s
        self.recent_loads.extend(meta.loads)
        sync = [s for s in meta.loads if not s.is_async]
        if sync:
            self._sync_job = self.fetcher.submit(sync, timeout)
        for spec in meta.loads:
            if spec.is_async:
                self._async_jobs[spec.req_id] = self.fetcher.submit([spec], timeout)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._sync_job
        if job is None:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None or job.wait_layer(layer, job.deadline):
            return
        self.stats.add(load_timeouts=1)
        logger.warning("kvcodec: load did not finish within %.1f s; recomputing its blocks", self.config.load_timeout_s)
        job.cancel()

    def _finish_sync_load(self) -> None:
        job = self._sync_job
        if job is None:
            return
        if not job.done.wait(max(0.0, job.deadline - time.monotonic())):
            self.stats.add(load_timeouts=1)
            job.cancel()
        job.settle()
        self._load_errors |= job.failed_blocks
        self._failed_reqs = set(job.failed_reqs)
        self._sync_job = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set()
        for req_id, job in list(self._async_jobs.items()):
            if not job.done.is_set() and time.monotonic() > job.deadline:
                self.stats.add(load_timeouts=1)
                job.cancel()
            if job.done.is_set():
                job.settle()
                self._load_errors |= job.failed_blocks
                done.add(req_id)
                del self._async_jobs[req_id]
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_sync_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- save -----------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: KVCodecMetadata) -> None:
        if not meta.saves:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None or self.caches[layer].data_ptr() != kv_layer.data_ptr():
            return  # a layer sharing another's KV: saved through its target
        for i, spec in enumerate(meta.saves):
            if not self._admit_save(i, len(spec.slots)):
                continue
            if self.gpu_save is not None:
                self.gpu_save.gather(i, layer, kv_layer, spec.slots)
            else:
                buf = self._gathered.get(i)
                if buf is None:
                    buf = self._gathered[i] = self._new_chunk_buffer(len(spec.slots))
                self.adapters[layer].gather(kv_layer, torch.tensor(spec.slots, dtype=torch.int64), out=buf[layer], check=False)
            self._gathered_layers[i] = self._gathered_layers.get(i, 0) + 1

    def _admit_save(self, index: int, tokens: int) -> bool:
        """Gather a chunk only if it fits under the saver's byte cap beside what this step already gathered.

        Without this a long prefill step would gather all its chunks first and
        only then meet the cap: memory would grow with the step, not the cap.
        """
        admitted = self._admitted.get(index)
        if admitted is None:
            a = self.adapters[0]
            nbytes = len(self.caches) * 2 * tokens * a.num_kv_heads * a.head_size * a.dtype.itemsize
            admitted = self.saver is not None and self.saver.has_room(self._admitted_bytes + nbytes)
            if admitted:
                self._admitted_bytes += nbytes
            elif self.saver is not None:
                self.saver.drop("before gathering", waiting=self._admitted_bytes)
            self._admitted[index] = admitted
        return admitted

    def _new_chunk_buffer(self, tokens: int) -> torch.Tensor:
        a = self.adapters[0]
        return torch.empty((len(self.caches), 2, tokens, a.num_kv_heads, a.head_size), dtype=a.dtype)

    def wait_for_save(self, meta: KVCodecMetadata | None) -> None:
        self._finish_sync_load()
        if meta is None or self.saver is None:
            return
        for i, spec in enumerate(meta.saves):
            if spec.req_id in self._failed_reqs:
                # Its prefix load failed, so this step computed the chunk from bad KV.
                self.stats.add(saves_skipped_after_load_failure=1)
            elif self._gathered_layers.get(i, 0) == len(self.caches):
                if self.gpu_save is not None:
                    self.gpu_save.submit(i, spec.chunk_hash)
                else:
                    self.saver.submit(spec.chunk_hash, self._gathered[i])
            elif i in self._gathered_layers:
                self.stats.add(saves_incomplete=1)
        if self.gpu_save is not None:
            self.gpu_save.release()
        self._gathered.clear()
        self._gathered_layers.clear()
        self._admitted.clear()
        self._admitted_bytes = 0
        self._failed_reqs = set()

    def shutdown(self) -> None:
        if self.gpu_save is not None:
            self.gpu_save.shutdown()
        if self.saver is not None:
            self.saver.shutdown()
        if self.fetcher is not None:
            self.fetcher.shutdown()
        self.store.close()


def _fetcher_class(caches: list[torch.Tensor]) -> type:
    """KV on a CUDA device loads through streams and Triton kernels (gpu/cuda_fetcher.py); elsewhere through threads."""
    if caches[0].is_cuda:
        from vllm_kvcodec.gpu.cuda_fetcher import CudaFetcher

        return CudaFetcher
    return Fetcher
