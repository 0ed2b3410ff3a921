"""``kvcodec bench schedule``: what lookups cost vLLM's scheduler loop, inline (sync), on the lookup thread (async),
and as ``auto`` chooses (the thread, waited for within the step's budget while the store answers within it).

Why: every call the connector makes from the scheduler stops the engine's
loop. The question is not a request's TTFT but everyone's: while
``schedule()`` waits on the store, no running request gets a token.

Setup: vLLM's real ``Scheduler`` with the connector's scheduler half (no
worker, no model: a step "runs" for ``step_ms``, and its output is fed back as
vLLM's model runner would: one token per request past its prompt). The store
is a file store behind the link emulator (``link+file://...?rtt_ms=``), every
chunk of the arriving prompts present in it (so lookups hit and loads are
planned as in production; no load is executed). One request decodes
throughout; then ``arrivals`` new requests of different prompts arrive in one
step. Per run: the time ``schedule()`` took in each step from the arrival
until every arrival was admitted (max and total), how many steps that took,
the wall time from arrival to the last admission, and the tokens the
decoding request got meanwhile (and, for auto, the requests answered within
the step that asked and the time the scheduler waited for them). Runs rotate
the modes, per RTT, so drift in a shared machine falls on each alike.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_kvcodec.tools.bench.report import console, machine, table, write_json

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK, CHUNK = 16, 256
#: A config vLLM's scheduler needs to exist (no weights are ever loaded).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 1000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}


def run(output: Path | None = Path("bench-results/schedule.json"), rtts_ms: tuple[float, ...] = (0.0, 1.0, 10.0),
        arrivals: int = 32, prompt_tokens: int = 1100, step_ms: float = 20.0, repeats: int = 3,
        modes: tuple[str, ...] = ("sync", "async", "auto")) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvcodec-schedule-"))
    rows: list[dict[str, Any]] = []
    try:
        prompts = [_prompt(prompt_tokens, seed) for seed in range(arrivals + 1)]
        _fill_store(tmp, prompts)
        for rtt in rtts_ms:
            for r in range(repeats):
                for mode in (modes if r % 2 == 0 else tuple(reversed(modes))):
                    row = _one_run(tmp, prompts, mode, rtt, step_ms)
                    row.update(repeat=r)
                    rows.append(row)
                    console.log(f"rtt {rtt} ms {mode}: arrival step schedule() {row['arrival_step_ms']:.1f} ms, "
                                f"all admitted after {row['steps_to_admit']} steps / {row['admit_wall_ms']:.0f} ms"
                                + (f", {row['answered_in_step']} answered within their step" if mode == "auto" else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = _summary(rows)
    result = {"benchmark": "schedule", "machine": machine(), "arrivals": arrivals, "prompt_tokens": prompt_tokens,
              "chunk_size": CHUNK, "step_ms": step_ms, "repeats": repeats, "runs": rows, "summary": summary}
    table(f"{arrivals} requests arriving in one step; schedule() per step (median of {repeats})",
          ["rtt ms / lookup", "arrival step ms", "max step ms", "schedule ms total", "steps to admit",
           "admit wall ms", "decode tokens", "answered in step", "waited ms"],
          [[f"{s['rtt_ms']} / {s['lookup']}", s["arrival_step_ms"], s["max_step_ms"], s["schedule_ms_total"],
            s["steps_to_admit"], s["admit_wall_ms"], s["decode_tokens"], s["answered_in_step"],
            s["lookup_wait_ms"]] for s in summary])
    write_json(result, output)
    return result


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 999) for _ in range(n)]


def _fill_store(tmp: Path, prompts: list[list[int]]) -> None:
    """Every full chunk of every prompt present in the store (lookups ask existence only: a few bytes each)."""
    from storage import open_store
    from vllm_kvcodec.keys.chain import chunk_hashes, chunk_object_keys

    scheduler = _scheduler(tmp, f"file://{tmp / 'store'}", "sync")
    half = scheduler.connector.scheduler
    with open_store(f"file://{tmp / 'store'}") as store:
        for tokens in prompts:
            for h in chunk_hashes(half.namespace, tokens, (len(tokens) - 1) // CHUNK):
                for key in chunk_object_keys(half.namespace, h, half.tp_size, half.groups):
                    store.put(key, b"x")
    scheduler.connector.shutdown()


def _scheduler(tmp: Path, store: str, lookup: str) -> Any:
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import torch

    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    transfer = KVTransferConfig(kv_connector="KVCodecConnector", kv_connector_module_path="vllm_kvcodec.connector",
                                kv_role="kv_both",
                                kv_connector_extra_config={"store": store, "chunk_size": CHUNK, "codec": "raw",
                                                           "model_id": "bench-schedule", "lookup": lookup,
                                                           "layers_per_object": 1})
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=8192, skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=65536, max_model_len=8192,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))
    blocks = 8192
    config.cache_config.num_gpu_blocks = blocks
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    with set_current_vllm_config(config):
        return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(config), block_size=BLOCK, log_stats=False)


def _request(req_id: str, tokens: list[int], max_tokens: int) -> Any:
    """A request with vLLM's block hasher, as its engine core makes it (the prefix cache needs the hashes)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def _step(scheduler: Any, step_s: float) -> tuple[float, Any]:
    """One step: schedule() (timed), a "forward" of ``step_s``, the output fed back."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    t0 = time.perf_counter()
    out = scheduler.schedule()
    took = time.perf_counter() - t0
    time.sleep(step_s)
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens + out.num_scheduled_tokens[req_id] >= request.num_prompt_tokens
        sampled.append([7] if done else [])
    runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=sampled, kv_connector_output=KVConnectorOutput())
    scheduler.update_from_output(out, runner)
    return took, out


def _one_run(tmp: Path, prompts: list[list[int]], lookup: str, rtt_ms: float, step_ms: float) -> dict[str, Any]:
    url = f"link+file://{tmp / 'store'}?gbps=100&rtt_ms={rtt_ms}"
    scheduler = _scheduler(tmp, url, lookup)
    step_s = step_ms / 1000
    decoder = _request("decoder", prompts[0][:100], max_tokens=100000)
    scheduler.add_request(decoder)
    for _ in range(3):
        _step(scheduler, step_s)  # the decoder runs
    new = [f"r{i}" for i in range(len(prompts) - 1)]
    for req_id, tokens in zip(new, prompts[1:]):
        scheduler.add_request(_request(req_id, tokens, max_tokens=4))
    before = decoder.num_output_tokens
    started = time.perf_counter()
    steps: list[float] = []
    admitted: set[str] = set()
    while len(admitted) < len(new) and len(steps) < 200:
        took, out = _step(scheduler, step_s)
        steps.append(took)
        admitted |= {r.req_id for r in out.scheduled_new_reqs}
    admit_wall = time.perf_counter() - started
    stats = scheduler.connector.stats()
    scheduler.connector.shutdown()
    return {"lookup": lookup, "rtt_ms": rtt_ms, "arrival_step_ms": steps[0] * 1e3, "max_step_ms": max(steps) * 1e3,
            "schedule_ms_total": sum(steps) * 1e3, "steps_to_admit": len(steps), "admit_wall_ms": admit_wall * 1e3,
            "decode_tokens": decoder.num_output_tokens - before, "step_ms": [s * 1e3 for s in steps],
            "hit_chunks": stats.get("hit_chunks", 0), "lookup_batches": stats.get("lookup_batches", 0),
            "answered_in_step": stats.get("lookups_answered_in_step", 0),
            "lookup_wait_ms": stats.get("lookup_wait_s", 0.0) * 1e3}


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in dict.fromkeys((r["rtt_ms"], r["lookup"]) for r in rows):
        group = [r for r in rows if (r["rtt_ms"], r["lookup"]) == key]
        med = {f: statistics.median(r[f] for r in group) for f in
               ("arrival_step_ms", "max_step_ms", "schedule_ms_total", "steps_to_admit", "admit_wall_ms",
                "decode_tokens", "hit_chunks", "answered_in_step", "lookup_wait_ms")}
        out.append({"rtt_ms": key[0], "lookup": key[1], **med})
    return out
