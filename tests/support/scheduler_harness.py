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
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

LAYERS, KV_HEADS, HEAD = 2, 2, 32
IDLE_STEP_S = 0.005  # how long a step with nothing scheduled takes
VOCAB = 1000
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
_MIX = np.array([(0x9E3779B97F4A7C15 * (2 * j + 1)) & (2**64 - 1) for j in range(2 * KV_HEADS * HEAD)], dtype=np.uint64)


def tiny_model_dir(root: Path) -> Path:
    """A Llama config small enough for the scheduler (no weights are ever loaded)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
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


def true_kv(tokens: list[int], start: int, stop: int, layer: int) -> torch.Tensor:
    """``[2, stop - start, heads, head]`` bf16: the fake model's K and V of positions ``[start, stop)``."""
    h = prefix_hashes(tokens[:stop])[start:stop]
    salt = np.uint64((layer + 1) * 0xD6E8FEB86659FD93 & (2**64 - 1))
    with np.errstate(over="ignore"):
        mixed = (h[:, None] ^ salt) * _MIX[None, :]
    bits = ((mixed >> np.uint64(52)) & np.uint64(0x0FFF)) | np.uint64(0x3000)  # finite, non-zero bf16
    kv = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    return kv.view(stop - start, 2, KV_HEADS, HEAD).transpose(0, 1).contiguous()


def poisoned(kv: torch.Tensor) -> torch.Tensor:
    """What the fake model writes when it read wrong context: the true KV with its last bit flipped.

    As with a real model, KV computed over wrong context is wrong itself, so a
    poisoned block served later (a local hit, a stored chunk) is caught by the
    context check of whoever reads it.
    """
    return (kv.view(torch.int16) ^ 1).view(torch.bfloat16)


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
    report: Any


class Engine:
    """One "engine": scheduler, worker half, paged KV, sharing a store URL with other engines."""

    _ids = itertools.count()

    def __init__(
        self, root: Path, store: str, *, block_size: int = 16, chunk_size: int = 32, num_blocks: int = 96,
        max_batched: int = 256, max_seqs: int = 8, policy: str | None = None, async_scheduling: bool = False,
        hooks: dict[str, Callable[..., None]] | None = None, **extra: Any,
    ) -> None:
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                                 VllmConfig, set_current_vllm_config)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_kvcodec.connector import KVCodecConnector

        self.block_size, self.chunk_size, self.num_blocks = block_size, chunk_size, num_blocks
        self.hooks = hooks or {}
        transfer: dict[str, Any] = {
            "kv_connector": "KVCodecConnector", "kv_connector_module_path": "vllm_kvcodec.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": store, "chunk_size": chunk_size, "codec": "raw",
                                          "model_id": "scheduler-harness", **extra},
        }
        if policy is not None:
            transfer["kv_load_failure_policy"] = policy
        max_len = 8192
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model_dir(root / "model")), dtype="bfloat16",
                                     max_model_len=max_len, skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
                                             max_model_len=max_len, is_encoder_decoder=False,
                                             enable_chunked_prefill=True, async_scheduling=async_scheduling),
            kv_transfer_config=KVTransferConfig(**transfer),
            device_config=DeviceConfig("cpu"),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])
        with set_current_vllm_config(self.vllm_config):
            self.layers = [Attention(4, HEAD, HEAD**-0.5, num_kv_heads=KV_HEADS, prefix=n) for n in LAYER_NAMES]
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                             structured_output_manager=StructuredOutputManager(self.vllm_config),
                             block_size=block_size, log_stats=True)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(block_size, hash_fn)
        with set_current_vllm_config(self.vllm_config):
            self.worker = KVCodecConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.caches = {n: torch.zeros(num_blocks, KV_HEADS, block_size, 2 * HEAD, dtype=torch.bfloat16)
                       for n in LAYER_NAMES}
        self.worker.register_kv_caches(self.caches)
        self.layouts = dict(zip(LAYER_NAMES, self.worker.worker.layouts))
        self.requests: dict[str, Any] = {}
        self.steps: list[StepRecord] = []
        self.finished: dict[str, Any] = {}
        self.pipelined = async_scheduling
        self._pending: tuple[Any, Any] | None = None  # pipelined: the step whose output is not delivered yet
        self.name = f"engine{next(self._ids)}"

    # ---- requests -------------------------------------------------------------------
    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 4) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(req_id, list(tokens), params, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        return request

    def abort(self, *req_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def block_table(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    # ---- one step -------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Schedule and execute one step; its output reaches the scheduler now, or (pipelined) after the next schedule.

        Pipelined is vLLM's async scheduling: step N+1 is scheduled, and runs
        on the worker, before the scheduler has seen step N's output.
        """
        out, runner_out, record = self._execute(self.scheduler.schedule())
        if self.pipelined:
            pending, self._pending = self._pending, (out, runner_out)
            if pending is not None:
                self._deliver(*pending)
        else:
            self._deliver(out, runner_out)
        return record

    def _execute(self, out: Any) -> tuple[Any, Any, StepRecord]:
        from vllm.v1.outputs import KVConnectorOutput

        meta = out.kv_connector_metadata
        tables = {r: self.block_table(r) for r in out.num_scheduled_tokens}
        computed = self._computed_before(out)
        self._check_plans(out, meta, tables, computed)
        if "before_forward" in self.hooks:
            self.hooks["before_forward"](self, out)
        w = self.worker
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        wrong: dict[str, str] = {}  # request -> what it read wrong, for this step
        for name in LAYER_NAMES:
            w.wait_for_layer_load(name)
            self._forward_layer(name, out, tables, computed, wrong)
            w.save_kv_layer(name, self.caches[name], None)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        report = w.build_connector_worker_meta()
        stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        undelivered = self._pending[1].kv_connector_output.invalid_block_ids if self._pending else set()
        self._check_context(tables, computed, invalid | undelivered, wrong)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving, invalid_block_ids=invalid,
            kv_connector_stats=stats, kv_connector_worker_meta=report,
        )
        record = StepRecord(len(self.steps), dict(out.num_scheduled_tokens), computed, list(meta.loads),
                            list(meta.saves), set(invalid), set(results.finished_recving or ()), report)
        self.steps.append(record)
        if not out.num_scheduled_tokens:
            time.sleep(IDLE_STEP_S)  # a real step takes time: let background loads run, as they would
        return out, self._runner_output(out, computed, kv_out), record

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
        """Step until every request finished (or ``until`` holds); a request that never finishes is a violation."""
        for _ in range(max_steps):
            if until is not None and until(self):
                return
            if until is None and not self.scheduler.has_requests():
                if self._pending is None:
                    return
                self.deliver()
                continue
            self.step()
        raise Violation(f"{self.name}: not done after {max_steps} steps; left: {list(self.scheduler.requests)}")

    def flush(self) -> None:
        assert self.worker.flush(60), "saves did not finish"

    def _computed_before(self, out: Any) -> dict[str, int]:
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(dict(zip(cached.req_ids, cached.num_computed_tokens)))
        return computed

    def _forward_layer(self, name: str, out: Any, tables: dict[str, list[int]], computed: dict[str, int],
                       wrong: dict[str, str]) -> None:
        """One layer of the fake forward: read each request's context, then write its new tokens' KV.

        The new KV is true only if the context was (:func:`poisoned` otherwise),
        and is written with vLLM's own CPU_ATTN write op.
        """
        from vllm_kvcodec.paged.cpu_attn import vllm_write
        from vllm_kvcodec.paged.slots import slots_for_tokens

        layer = LAYER_NAMES.index(name)
        isa = self.layouts[name].isa
        for req_id, n in out.num_scheduled_tokens.items():
            start = computed[req_id]
            tokens = self._tokens(req_id, start + n)
            stop = min(start + n, len(tokens))
            problem = self._read_context(name, layer, tokens, tables[req_id], start)
            if problem:
                wrong.setdefault(req_id, problem)
            if stop <= start:
                continue
            kv = true_kv(tokens, start, stop, layer)
            slots = slots_for_tokens(tables[req_id], self.block_size, start, stop)
            vllm_write(self.caches[name], slots, poisoned(kv) if req_id in wrong else kv, isa)

    def _read_context(self, name: str, layer: int, tokens: list[int], table: list[int], start: int) -> str:
        """What attention reads for a request: its first ``start`` tokens' KV. '' if all of it is right."""
        from vllm_kvcodec.paged.slots import slots_for_tokens

        if start == 0:
            return ""
        slots = slots_for_tokens(table, self.block_size, 0, start)
        got = self.layouts[name].gather(self.caches[name], slots).view(torch.int16)
        want = true_kv(tokens, 0, start, layer).view(torch.int16)
        if torch.equal(got, want):
            return ""
        bad = int((got != want).reshape(2, start, -1).any(-1).any(0).nonzero()[0])
        return f"wrong KV at position {bad} of {start} (layer {name}, block {table[bad // self.block_size]})"

    def _tokens(self, req_id: str, upto: int) -> list[int]:
        """The request's tokens, plus those its sampler will produce (pipelined steps run ahead of the output)."""
        request = self.requests[req_id]
        tokens = list(request.all_token_ids)
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
    def _check_plans(self, out: Any, meta: Any, tables: dict[str, list[int]], computed: dict[str, int]) -> None:
        from vllm_kvcodec.keys import chunk_hashes
        from vllm_kvcodec.paged.slots import slots_for_tokens

        ns = self.connector.scheduler.namespace
        bs, cs = self.block_size, self.chunk_size
        for spec in meta.loads:
            table = tables.get(spec.req_id) or self.block_table(spec.req_id)
            tokens = self.requests[spec.req_id].all_token_ids
            hashes = chunk_hashes(ns, tokens, len(tokens) // cs)
            for chunk in spec.chunks:
                c = hashes.index(chunk.chunk_hash) if chunk.chunk_hash in hashes else -1
                if c < 0:
                    raise Violation(f"load of {spec.req_id} names chunk {chunk.chunk_hash[:8]} not of its prompt")
                a = c * cs + chunk.first_token
                want = slots_for_tokens(table, bs, a, a + len(chunk.slots)).tolist()
                if chunk.slots != want or a + len(chunk.slots) > (c + 1) * cs:
                    raise Violation(f"load of {spec.req_id} chunk {c}: slots disagree with its block table")
                if a + len(chunk.slots) >= len(tokens):
                    raise Violation(f"load of {spec.req_id} covers its last token")
        for spec in meta.saves:
            table = tables[spec.req_id]
            tokens = self.requests[spec.req_id].all_token_ids
            done = min(computed[spec.req_id] + out.num_scheduled_tokens[spec.req_id], len(tokens))
            hashes = chunk_hashes(ns, tokens, done // cs)
            if spec.chunk_hash not in hashes:
                raise Violation(f"save of {spec.req_id} names chunk {spec.chunk_hash[:8]}, not complete after this step")
            c = hashes.index(spec.chunk_hash)
            if spec.slots != slots_for_tokens(table, bs, c * cs, (c + 1) * cs).tolist():
                raise Violation(f"save of {spec.req_id} chunk {c}: slots disagree with its block table")

    def _check_context(self, tables: dict[str, list[int]], computed: dict[str, int], invalid: set[int],
                       wrong: dict[str, str]) -> None:
        """Wrong context is allowed only to a request vLLM rewinds for a load that failed in this step."""
        for req_id, problem in wrong.items():
            blocks = tables[req_id][: -(-computed[req_id] // self.block_size)]
            if not any(b in invalid for b in blocks):
                raise Violation(f"step {len(self.steps)}: {req_id} read {problem}")

    def assert_empty(self) -> None:
        """Nothing leaked: vLLM's scheduler, block pool and the connector's two halves hold no request state."""
        s = self.scheduler
        assert not s.requests and not s.running and not len(s.waiting), f"requests left: {list(s.requests)}"
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1, "blocks still held"
        state = self.connector.scheduler.state()
        assert state == {"requests": [], "pending_loads": 0, "inflight_loads": []}, state
        self.flush()
        worker = self.worker.worker
        assert not worker._async_jobs and worker._sync_job is None
        assert worker.save_gather._step is None and not worker._load_failures, "worker state left"

    def cached_block_ids(self) -> set[int]:
        """Blocks vLLM's prefix cache would hand out as a local hit."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return {b.block_id for b in pool.blocks if b.block_hash is not None}

    def stats(self) -> dict[str, float]:
        return self.worker.stats()

    def scheduler_stats(self) -> dict[str, float]:
        return self.connector.stats()

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def loads_of(engine: Engine, req_ids: Iterable[str] | None = None) -> list[Any]:
    wanted = set(req_ids) if req_ids is not None else None
    return [spec for step in engine.steps for spec in step.loads if wanted is None or spec.req_id in wanted]


def loaded_tokens(engine: Engine, req_id: str) -> int:
    return sum(len(c.slots) for spec in loads_of(engine, [req_id]) for c in spec.chunks)
