"""``kvcodec bench serve`` against a far Redis behind an emulated 1 Gbit/s, 10 ms link, with and without a near tier.

Starts a private redis-server, then runs :func:`vllm_kvcodec.tools.bench.serve.run`
(vLLM's own client, prefix_repetition; each run a ``none``, a ``save`` and a
``load`` server) alternately with the two store URLs, so drift on the shared
host falls on both alike:

- far only: ``link+redis://...?gbps=1&rtt_ms=10``
- near tier: ``cache+link+redis://...?gbps=1&rtt_ms=10&near=file://<dir>&near_bytes=2GiB``, one near
  directory per repeat on this host: the ``save`` server writes it and the far store, the ``load`` server (a
  restart on the same host) finds the prefixes near.

What this shows is the load server's TTFT when the prefixes it serves again
come from the far store over the emulated link, or from the host's near tier;
and the far-store bytes it reads per request. (A workload with more distinct
prefixes than the engine's KV cache, so that one server reloads its own
evicted prefixes, ran over 12 minutes per server on the shared 2-core host and
was stopped.)
Per load run it prints TTFT p50/p99 and the far-store bytes read per request
(``loaded_bytes`` without a near tier; the near tier's far reads with one).
Writes bench-results/near_tier_serve.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from storage.testing.redis_server import start_redis_server
from vllm_kvcodec.tools.bench import serve

WORKLOAD = {"num_prompts": 24, "prefix_len": 1024, "suffix_len": 32, "num_prefixes": 4, "output_len": 4,
            "request_rate": "inf"}


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
    near_root = ""
    try:
        link = "gbps=1&rtt_ms=10"
        near_root = tempfile.mkdtemp(prefix="kvcodec-near-")
        for r in range(repeats):
            configs = {"far only": f"link+{server.url}?{link}",
                       "near tier": f"cache+link+{server.url}?{link}&near=file://{near_root}/r{r}&near_bytes=2GiB"}
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
        shutil.rmtree(near_root, ignore_errors=True)
    out = Path("bench-results/near_tier_serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "near_tier_serve", "workload": WORKLOAD, "rows": rows,
                               "note": "shared 2-core host; TTFT noisy"}, indent=2))


if __name__ == "__main__":
    main()
