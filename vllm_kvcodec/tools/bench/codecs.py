"""Ratio and single-core speed of every codec on real 256-token SmolLM2 KV chunks.

``zstd`` at level 1 over the split planes is measured in the same run as the
yardstick the issue targets are relative to. Speeds are MB/s of raw KV
(uncompressed bytes per second), best of ``repeats`` passes over all chunks,
one thread.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from vllm_kvcodec.tools.bench.report import console, machine, table, write_json
from vllm_kvcodec.codecs import codec_ids, get_codec
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.runtime.malloc import reuse_large_buffers

YARDSTICK = {"id": "zstd", "level": 1}


def default_codecs() -> list[dict[str, Any]]:
    configs: list[dict[str, Any]] = [{"id": "raw"}, YARDSTICK, {"id": "zstd", "level": 3}, {"id": "splitzip"}, {"id": "rans"}]
    if "video" in codec_ids():
        configs += [{"id": "video", "backend": b} for b in ("hevc", "ffv1")]
    return configs


def measure(chunks: list[torch.Tensor], config: dict[str, Any], repeats: int) -> dict[str, Any]:
    codec = get_codec(config)
    raw = sum(c.numel() * c.element_size() for c in chunks)
    blobs = [encode_chunk(c, codec) for c in chunks]  # warm-up (JIT) and the blobs to decode
    enc = min(_timed(lambda: [encode_chunk(c, codec) for c in chunks]) for _ in range(repeats))
    dec = min(_timed(lambda: [decode_chunk(b) for b in blobs]) for _ in range(repeats))
    exact = all(torch.equal(decode_chunk(b).view(torch.int16), c.view(torch.int16)) for b, c in zip(blobs, chunks))
    return {
        "codec": codec.get_config(),
        "name": _name(codec.get_config()),
        "ratio": raw / sum(len(b) for b in blobs),
        "encode_MBps": raw / enc / 1e6,
        "decode_MBps": raw / dec / 1e6,
        "bit_exact": exact,
    }


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _name(config: dict[str, Any]) -> str:
    extra = ",".join(f"{k}={v}" for k, v in config.items() if k != "id")
    return f"{config['id']}({extra})" if extra else config["id"]


def run(
    output: Path | None = None,
    tokens: int = 4096,
    chunk_tokens: int = 256,
    repeats: int = 3,
    codecs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    from vllm_kvcodec.tools.smollm2 import real_kv

    torch.set_num_threads(1)
    reuse_large_buffers()
    with console.status("building real SmolLM2 KV (cached after the first run)"):
        kv = real_kv(tokens)
    chunks = [c.contiguous() for c in kv.split(chunk_tokens, dim=2)]
    configs = codecs or default_codecs()
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("codecs", total=len(configs))
        for config in configs:
            progress.update(task, description=f"measuring {_name(config)}")
            results.append(measure(chunks, config, repeats))
            progress.advance(task)
    result = {"benchmark": "codecs", "machine": machine(), "malloc_tuned": reuse_large_buffers(), "tokens": tokens, "chunk_tokens": chunk_tokens,
              "chunk_shape": list(chunks[0].shape), "threads": 1, "results": results, "targets": _targets(results)}
    table(
        f"codecs on real SmolLM2-135M KV, {len(chunks)} chunks of {chunk_tokens} tokens, 1 thread",
        ["codec", "ratio", "encode MB/s", "decode MB/s", "bit-exact"],
        [[r["name"], r["ratio"], r["encode_MBps"], r["decode_MBps"], "yes" if r["bit_exact"] else "NO"] for r in results],
    )
    for name, t in result["targets"].items():
        console.print(f"{name}: {t['value']:.3f} (target {t['target']}) {'met' if t['met'] else 'NOT met'}")
    write_json(result, output)
    return result


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["name"]: r for r in results}
    base, sz = by.get("zstd(level=1)"), by.get("splitzip")
    out: dict[str, Any] = {}
    if base and sz:
        out["splitzip ratio"] = _t(sz["ratio"], 1.33)
        out["splitzip decode / zstd-1 decode"] = _t(sz["decode_MBps"] / base["decode_MBps"], 3.0)
        out["splitzip encode / zstd-1 encode"] = _t(sz["encode_MBps"] / base["encode_MBps"], 2.0)
    exact = [r for r in results if r["bit_exact"]]
    if exact:
        out["best bit-exact ratio"] = _t(max(r["ratio"] for r in exact), 1.50)
    return out


def _t(value: float, target: float) -> dict[str, Any]:
    return {"value": value, "target": f">= {target}", "met": value >= target}
