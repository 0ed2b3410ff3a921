"""``kvcodec bench serve``'s servers and client against a far Redis behind an emulated 1 Gbit/s, 10 ms link.

Steps (each one real ``kvcodec serve`` process and vLLM's own ``vllm bench
serve`` client, prefix_repetition, through :mod:`vllm_kvcodec.tools.bench.serve`):

- ``save``: a server computes the prefixes and saves them into the far store
  (``link+redis://...?gbps=1&rtt_ms=10``), then stops (its queued saves land);
- ``far``: a fresh loading server on the far store alone;
- ``near_cold``: a fresh loading server with a near tier on this host
  (``cache+...&near=file://<dir>&near_bytes=2GiB``), its directory empty: it
  reads from far and fills the near tier;
- ``near_warm``: the same again (a restart on the same host): its prefixes come
  from the near tier.

Per step: TTFT p50/p99 (vLLM's client) and the far-store bytes read per request
(``loaded_bytes`` without a near tier; the near tier's far read bytes with one).
Writes bench-results/near_tier_serve.json. The host may be shared: TTFT is
noisy there, the byte counts are exact.

``--redis-url`` and ``--prefix`` reuse a far store that a ``save`` step already
filled (``--steps near_cold,near_warm``). A step may repeat (``save,far,far``).
``--keep DIR`` keeps each step's server and client logs there. TTFT is only
comparable between runs on a host with nothing else running (docs/tiers.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from storage.testing.redis_server import start_redis_server
from vllm_kvcodec.tools.bench import serve

WORKLOAD = {"num_prompts": 24, "prefix_len": 1024, "suffix_len": 32, "num_prefixes": 4, "output_len": 4,
            "request_rate": "inf", "seed": 42}
CONNECTOR = {"codec": "rans", "save_thread_nice": 0, "save_codec_when_behind": "splitzip"}


def far_bytes(counters: dict[str, float]) -> float:
    """Bytes the load server read from the far store."""
    near, far = counters.get("tier_read_bytes{tier=near}", 0.0), counters.get("tier_read_bytes{tier=far}", 0.0)
    return far if near + far > 0 else counters.get("loaded_bytes", 0.0)  # the series exist (at 0) without a tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default="save,far,near_cold,near_warm")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--prefix", default=None)
    parser.add_argument("--output", type=Path, default=Path("bench-results/near_tier_serve.json"))
    parser.add_argument("--keep", type=Path, default=None,
                        help="a directory for each step's server and client logs, kept after the run")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_kvcodec.tools.smollm2 import model_dir

    model = str(model_dir())
    client = serve._client_args(model, WORKLOAD["num_prompts"], WORKLOAD["prefix_len"], WORKLOAD["suffix_len"],
                                WORKLOAD["num_prefixes"], WORKLOAD["output_len"], WORKLOAD["request_rate"],
                                WORKLOAD["seed"])
    server = None if args.redis_url else start_redis_server()
    redis_url = args.redis_url or server.url
    prefix = args.prefix or f"kvcodec-bench-near/{uuid.uuid4().hex[:12]}/"
    far = f"link+{redis_url}?gbps=1&rtt_ms=10&prefix={prefix}"
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvcodec-near-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    near = f"cache+{far}&near=file://{work / 'near'}&near_bytes=2GiB"
    urls = {"save": far, "far": far, "near_cold": near, "near_warm": near}
    rows: list[dict[str, Any]] = []
    try:
        for i, step in enumerate(args.steps.split(",")):
            kind = "save" if step == "save" else "load"
            r = serve._one_run(kind, model, urls[step], CONNECTOR, client, work / f"{i}-{step}")
            row = {"step": step, "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                   "mean_ttft_ms": r["mean_ttft_ms"], "completed": r["completed"], "failed": r["failed"],
                   "far_read_bytes_per_request": far_bytes(r["counters"]) / max(1, r["completed"]),
                   "loaded_tokens": r["counters"].get("loaded_tokens", 0), "counters": r["counters"]}
            rows.append(row)
            print(f"{step}: TTFT p50 {row['median_ttft_ms']:.0f} ms, p99 {row['p99_ttft_ms']:.0f} ms, far bytes/request "
                  f"{row['far_read_bytes_per_request'] / 2**20:.2f} MiB, loaded tokens {row['loaded_tokens']:.0f}, "
                  f"{row['failed']} failed", flush=True)
    finally:
        if server is not None:
            server.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(work / "near", ignore_errors=True)  # the near tier's objects; the logs stay
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"benchmark": "near_tier_serve", "workload": WORKLOAD, "connector": CONNECTOR,
                                           "far": "link+redis (1 Gbit/s, 10 ms RTT)", "rows": rows,
                                           "note": "shared 2-core host; TTFT noisy, bytes exact"}, indent=2))


if __name__ == "__main__":
    main()
