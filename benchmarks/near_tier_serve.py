"""``kvcodec bench serve`` against a far Redis behind an emulated 1 Gbit/s, 10 ms link, with and without a near tier.

Starts a private redis-server, then runs :func:`vllm_kvcodec.tools.bench.serve.run`
(vLLM's own client, prefix_repetition; each run a ``none``, a ``save`` and a
``load`` server) alternately with the two store URLs, so drift on the shared
host falls on both alike:

- far only: ``link+redis://...?gbps=1&rtt_ms=10``
- near tier: ``cache+link+redis://...?gbps=1&rtt_ms=10&near=memory://bench-near&near_bytes=2GiB``
  (a fresh in-process near tier per server, shared by its scheduler and worker halves)

The workload has more distinct prefixes than the engine's own KV cache holds
(set ``VLLM_CPU_KVCACHE_SPACE=1``), so a prefix that comes back has often been
evicted locally and is loaded again: from the far store, or from the near tier.
Per load run it prints TTFT p50/p99 and the far-store bytes read per request
(``loaded_bytes`` without a near tier; the near tier's far reads with one).
Writes bench-results/near_tier_serve.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from storage.testing.redis_server import start_redis_server
from vllm_kvcodec.tools.bench import serve

WORKLOAD = {"num_prompts": 192, "prefix_len": 1024, "suffix_len": 32, "num_prefixes": 64, "output_len": 4,
            "request_rate": "4"}


def far_bytes(counters: dict[str, float]) -> float:
    """Bytes the load server read from the far store."""
    if "tier_read_bytes{tier=far}" in counters or "tier_read_bytes{tier=near}" in counters:
        return counters.get("tier_read_bytes{tier=far}", 0.0)
    return counters.get("loaded_bytes", 0.0)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    server = start_redis_server()
    rows = []
    try:
        link = "gbps=1&rtt_ms=10"
        configs = {"far only": f"link+{server.url}?{link}",
                   "near tier": f"cache+link+{server.url}?{link}&near=memory://bench-near&near_bytes=2GiB"}
        for r in range(repeats):
            for label in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                result = serve.run(output=Path(f"bench-results/near_tier_serve_{label.replace(' ', '_')}_{r}.json"),
                                   repeats=1, store=configs[label], **WORKLOAD)
                load = next(x for x in result["runs"] if x["kind"] == "load")
                row = {"config": label, "repeat": r, "median_ttft_ms": load["median_ttft_ms"],
                       "p99_ttft_ms": load["p99_ttft_ms"], "mean_ttft_ms": load["mean_ttft_ms"],
                       "completed": load["completed"], "failed": load["failed"],
                       "far_read_bytes_per_request": far_bytes(load["counters"]) / max(1, load["completed"]),
                       "loaded_tokens": load["counters"].get("loaded_tokens", 0),
                       "counters": load["counters"]}
                rows.append(row)
                print(f"{label}: TTFT p50 {row['median_ttft_ms']:.0f} ms, p99 {row['p99_ttft_ms']:.0f} ms, far bytes/request "
                      f"{row['far_read_bytes_per_request'] / 2**20:.2f} MiB, loaded tokens {row['loaded_tokens']:.0f}",
                      flush=True)
    finally:
        server.stop()
    out = Path("bench-results/near_tier_serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "near_tier_serve", "workload": WORKLOAD, "rows": rows,
                               "note": "shared 2-core host; TTFT noisy"}, indent=2))


if __name__ == "__main__":
    main()
