"""Peak memory of saving and loading a 32k-token prefix through the real Saver and Fetcher.

Each phase runs in a fresh spawned process, set up as the worker half sets
itself up (``reuse_large_buffers``, a CPU_ATTN paged KV cache per layer with
the layout vLLM's layout calls for, a file store, the ``ObjectAddresses`` of
a SmolLM2-135M namespace with vLLM's default 6 layer groups). The baseline is
the process's resident set after that set-up and a warm-up (imports, numba
kernels, the paged cache itself and the source KV: the engine owns those
anyway) and after ``malloc_trim`` (so freed heap cannot hide allocations);
the kernel's peak-RSS mark is then reset (``/proc/self/clear_refs``) and the
phase's peak is ``ru_maxrss`` afterwards, minus the baseline.

* save: the prefix is prefilled in steps of ``step_tokens`` (vLLM's
  ``max_num_batched_tokens``); per step every completed chunk is gathered
  out of paged memory into its own buffer (``save_kv_layer``) if it fits
  under the saver's cap beside the step's others, then all of them are handed to the :class:`~vllm_kvcodec.save.saver.Saver`
  (``wait_for_save``), with no compute time between steps (the worst case
  for the queue), then flushed. Gathered buffers live until encoded; queued
  raw bytes are capped by ``max_pending_save_bytes``, beyond which saves are
  dropped (counted).
* load: one :class:`~vllm_kvcodec.load.fetcher.Fetcher` job for the whole prefix
  (all chunks x all layer groups), then every token is compared bit-exactly
  with the source (after the peak is read).

The 32768-token source is ``real_kv(4096)`` (real SmolLM2 KV) repeated 8
times, copy ``t`` rolled by ``37 t`` tokens along the token axis, so every
256-token chunk holds distinct real KV.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_kvcodec.tools.bench.report import console, machine, table, write_json

SOURCE_TOKENS = 4096
ROLL = 37
BLOCK_SIZE = 16
CHUNK_TOKENS = 256


# ---- measurement --------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Return freed heap to the OS, then reset the kernel's peak-RSS mark (Linux >= 4.0).

    Without the trim, heap the set-up freed (``reuse_large_buffers`` keeps it
    mapped) would be reused by the phase without raising RSS, hiding part of
    the phase's allocations. False if this kernel does not allow the reset.
    """
    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---- the prefix and its paged cache ---------------------------------------------------------------
def source_tile(base: Any, t: int) -> Any:
    import torch

    return torch.roll(base, shifts=ROLL * t, dims=2).contiguous()


def _setup(tokens: int, store_url: str, codec: str) -> dict[str, Any]:
    """What WorkerHalf.register_kv_caches builds, over plain tensors in CPU_ATTN layout."""
    import torch

    from storage import open_store
    from vllm_kvcodec.connector.config import ConnectorConfig
    from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses, chunk_hashes
    from vllm_kvcodec.runtime.malloc import reuse_large_buffers
    from vllm_kvcodec.paged import CANONICAL_NAMESPACE, layout_for
    from vllm_kvcodec.tools.smollm2 import real_kv

    torch.set_num_threads(1)
    reuse_large_buffers()
    base = real_kv(SOURCE_TOKENS)
    layers, _, _, heads, dim = base.shape
    blocks = tokens // BLOCK_SIZE
    caches = [torch.zeros((blocks, heads, BLOCK_SIZE, 2 * dim), dtype=base.dtype) for _ in range(layers)]
    layout = layout_for("CPU_ATTN", caches[0], block_size=BLOCK_SIZE, head_size=dim, num_kv_heads=heads)
    block_ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))  # a fragmented block table
    slots = (block_ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1)
    namespace = Namespace(model_id="bench-memory", dtype="bfloat16", num_layers=layers, num_kv_heads=heads,
                          head_dim=dim, layout_id=CANONICAL_NAMESPACE, tp_size=1, chunk_size=CHUNK_TOKENS,
                          layers_per_object=ConnectorConfig(codec=codec, store=store_url).object_layers(layers))
    groups = namespace.layer_groups()
    hashes = chunk_hashes(namespace, list(range(tokens)), tokens // CHUNK_TOKENS)
    return {"base": base, "caches": caches, "layout": layout, "slots": slots, "block_ids": block_ids,
            "hashes": hashes, "store": open_store(store_url),
            "addresses": ObjectAddresses(namespace, 0, tuple(groups)), "tokens": tokens}


def _fill_cache(env: dict[str, Any]) -> None:
    """Scatter the prefix into paged memory, as the engine's forward pass would have."""
    for t in range(env["tokens"] // SOURCE_TOKENS):
        tile = source_tile(env["base"], t)
        part = env["slots"][t * SOURCE_TOKENS : (t + 1) * SOURCE_TOKENS]
        for layer, cache in enumerate(env["caches"]):
            env["layout"].scatter(cache, part, tile[layer])


def _chunk_slots(env: dict[str, Any], c: int) -> Any:
    return env["slots"][c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]


# ---- phases (each in a fresh process) ----------------------------------------------------------------
def _save_phase(env: dict[str, Any], codec: str, threads: int, max_pending: int, step_tokens: int) -> dict[str, Any]:
    """The worker's save path, step by step: the real CPU gather (budget reserved before each copy), then the Saver."""
    from types import SimpleNamespace

    from vllm_kvcodec.save.codec_choice import CodecChooser
    from vllm_kvcodec.stats import ConnectorStats
    from vllm_kvcodec.format import decode_chunk, encode_chunk
    from vllm_kvcodec.save.gather import CpuSaveGather
    from vllm_kvcodec.save.saver import Saver

    _fill_cache(env)
    decode_chunk(encode_chunk(env["base"][:5, :, :CHUNK_TOKENS], codec))  # warm-up: numba kernels
    stats = ConnectorStats()
    saver = Saver(env["store"], env["addresses"], CodecChooser(codec), threads, max_pending, stats)
    caches = env["caches"]
    gather = CpuSaveGather(caches, [env["layout"]] * len(caches), saver)
    per_step = max(1, step_tokens // CHUNK_TOKENS)
    reset = _reset_peak()
    baseline = _rss()
    t0 = time.perf_counter()
    for first in range(0, len(env["hashes"]), per_step):
        specs = [SimpleNamespace(req_id="bench", chunk_hash=env["hashes"][c], group_slots=[_chunk_slots(env, c).tolist()],
                                 tokens=CHUNK_TOKENS)
                 for c in range(first, min(first + per_step, len(env["hashes"])))]
        for layer, cache in enumerate(caches):  # save_kv_layer, layer by layer
            gather.gather_layer(layer, cache, specs)
        gather.end_step(specs, lambda spec: True)  # wait_for_save: hand the step's chunks to the saver
    saver.flush()
    seconds = time.perf_counter() - t0
    peak = _peak()
    saver.shutdown()
    return {"baseline_bytes": baseline, "peak_bytes": peak, "growth_bytes": peak - baseline, "peak_reset": reset,
            "seconds": seconds, "stats": stats.totals()}


def _load_phase(env: dict[str, Any], threads: int) -> dict[str, Any]:
    from vllm_kvcodec.load.fetcher import Fetcher
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
    from vllm_kvcodec.plans.spans import Span
    from vllm_kvcodec.stats import ConnectorStats

    caches, layout, addresses = env["caches"], env["layout"], env["addresses"]
    decode_chunk(env["store"].get(addresses.key(env["hashes"][0], 0)))  # warm-up: numba kernels
    stats = ConnectorStats()
    fetcher = Fetcher(env["store"], addresses, caches, [layout] * len(caches), threads, stats)
    chunks = [ChunkLoad(h, [Span(0, _chunk_slots(env, c).tolist())],
                        env["block_ids"][c * CHUNK_TOKENS // BLOCK_SIZE : (c + 1) * CHUNK_TOKENS // BLOCK_SIZE].tolist())
              for c, h in enumerate(env["hashes"])]
    reset = _reset_peak()
    baseline = _rss()
    t0 = time.perf_counter()
    job = fetcher.submit([LoadSpec("bench", chunks, False)], timeout_s=3600)
    job.done.wait()
    seconds = time.perf_counter() - t0
    peak = _peak()
    fetcher.shutdown()
    exact = not job.failed_blocks and _matches_source(env)
    return {"baseline_bytes": baseline, "peak_bytes": peak, "growth_bytes": peak - baseline, "peak_reset": reset,
            "seconds": seconds, "failed_blocks": len(job.failed_blocks), "bit_exact": exact, "stats": stats.totals()}


def _matches_source(env: dict[str, Any]) -> bool:
    import torch

    for t in range(env["tokens"] // SOURCE_TOKENS):
        tile = source_tile(env["base"], t)
        part = env["slots"][t * SOURCE_TOKENS : (t + 1) * SOURCE_TOKENS]
        for layer, cache in enumerate(env["caches"]):
            got = env["layout"].gather(cache, part)
            if not torch.equal(got.view(torch.int16), tile[layer].view(torch.int16)):
                return False
    return True


def _child(phase: str, kwargs: dict[str, Any], results: Any) -> None:
    try:
        env = _setup(kwargs["tokens"], kwargs["store_url"], kwargs["codec"])
        if phase == "save":
            out = _save_phase(env, kwargs["codec"], kwargs["save_threads"], kwargs["max_pending"], kwargs["step_tokens"])
        else:
            out = _load_phase(env, kwargs["fetch_threads"])
        env["store"].close()
        results.put(out)
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        import traceback

        results.put({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"})


def _in_fresh_process(phase: str, **kwargs: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(phase, kwargs, results))
    proc.start()
    out = results.get(timeout=1800)
    proc.join(60)
    if "error" in out:
        raise RuntimeError(f"{phase} phase failed: {out['error']}")
    return {"phase": phase, **{k: v for k, v in kwargs.items() if k != "store_url"}, **out}


def run(output: Path | None = None, tokens: int = 32768, codecs: list[str] | None = None, fetch_threads: int = 4,
        save_threads: int = 2, max_pending_save_bytes: int = 512 << 20, step_tokens: int = 8192,
        load: bool = True) -> dict[str, Any]:
    if tokens % SOURCE_TOKENS:
        raise ValueError(f"tokens must be a multiple of {SOURCE_TOKENS}")
    codecs = codecs or ["rans", "raw"]
    results = []
    for codec in codecs:
        root = Path(tempfile.mkdtemp(prefix="kvcodec-bench-memory-"))
        try:
            common = {"tokens": tokens, "codec": codec, "store_url": f"file://{root}"}
            with console.status(f"{codec}: saving {tokens} tokens"):
                results.append(_in_fresh_process("save", save_threads=save_threads, max_pending=max_pending_save_bytes,
                                                 step_tokens=step_tokens, **common))
            if not load:
                continue
            with console.status(f"{codec}: loading {tokens} tokens"):
                results.append(_in_fresh_process("load", fetch_threads=fetch_threads, **common))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    raw_bytes = tokens * 30 * 2 * 3 * 64 * 2
    result = {"benchmark": "memory", "machine": machine(), "tokens": tokens, "prefix_raw_bytes": raw_bytes,
              "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS, "step_tokens": step_tokens,
              "max_pending_save_bytes": max_pending_save_bytes, "results": results}
    table(f"peak RSS above baseline, {tokens}-token prefix ({raw_bytes / 2**20:.0f} MiB of bf16 KV), file store",
          ["codec", "phase", "threads", "growth MiB", "/ prefix", "seconds", "dropped", "bit-exact"],
          [[r["codec"], r["phase"], r.get("save_threads", r.get("fetch_threads")), r["growth_bytes"] / 2**20,
            r["growth_bytes"] / raw_bytes, r["seconds"], r["stats"].get("saves_dropped", 0),
            {True: "yes", False: "NO"}.get(r.get("bit_exact"), "-")] for r in results])
    write_json(result, output)
    return result
