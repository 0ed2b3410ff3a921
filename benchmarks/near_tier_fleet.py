"""Several engines sharing one far store, each with or without its own near tier: far-store read load and load time.

Why a harness and not ``kvcodec bench serve``: serve runs one engine at a
time, and several vLLM engines at once do not fit a 2-core host. Here each
"engine" is what the worker half builds to load (a real
:class:`~vllm_kvcodec.load.fetcher.Fetcher`, CPU_ATTN paged caches of real
SmolLM2-135M KV, its own store handle opened from a URL), and all of them read
one real redis-server, each through its own emulated link (1 Gbit/s, 10 ms
RTT by default: one NIC per engine). A writer saves ``prefixes`` prefixes of
``tokens`` tokens (encoded with ``codec``, keyed as the connector keys them)
into the far store; then every engine loads every prefix ``rounds`` times in a
seeded random order; the configurations' loads are interleaved one by one (A/B). Per load: wall
seconds from submit to the last object in place (the load's part of TTFT);
per configuration: bytes read from the far store (the fleet's load on it),
per request and in total. Every load is checked bit-exact against its source.

Run: ``PYTHONPATH=. python benchmarks/near_tier_fleet.py`` (writes
bench-results/near_tier_fleet.json). The host may be shared: the byte counts
are exact, the seconds are not.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

BLOCK_SIZE = 16
CHUNK_TOKENS = 256


def _prefixes(count: int, tokens: int) -> list[torch.Tensor]:
    """``count`` distinct prefixes of real KV: SmolLM2 KV of 4096 tokens, rolled per prefix."""
    from vllm_kvcodec.tools.smollm2 import real_kv

    base = real_kv(4096)
    return [torch.roll(base, shifts=97 * (p + 1), dims=2)[:, :, :tokens].contiguous() for p in range(count)]


def _namespace(kv: torch.Tensor, store_url: str, codec: str) -> Any:
    from vllm_kvcodec.connector.config import ConnectorConfig
    from vllm_kvcodec.keys.chain import Namespace
    from vllm_kvcodec.paged import CANONICAL_NAMESPACE

    layers, _, _, heads, dim = kv.shape
    return Namespace(model_id="bench-near-tier", dtype="bfloat16", num_layers=layers, num_kv_heads=heads,
                     head_dim=dim, layout_id=CANONICAL_NAMESPACE, tp_size=1, chunk_size=CHUNK_TOKENS,
                     layers_per_object=ConnectorConfig(codec=codec, store=store_url).object_layers(layers))


def _save(far_url: str, prefixes: list[torch.Tensor], codec: str) -> tuple[Any, list[list[str]], int]:
    """Encode and put every prefix's objects into the far store, as the saver would; (addresses, hashes, bytes)."""
    from storage import open_store
    from vllm_kvcodec.codecs import get_codec
    from vllm_kvcodec.format import encode_chunk
    from vllm_kvcodec.keys.chain import ObjectAddresses, chunk_hashes

    namespace = _namespace(prefixes[0], far_url, codec)
    addresses = ObjectAddresses(namespace, 0, tuple(namespace.layer_groups()))
    tokens = prefixes[0].shape[2]
    all_hashes, stored = [], 0
    with open_store(far_url) as far:
        for p, kv in enumerate(prefixes):
            hashes = chunk_hashes(namespace, [p * 100_000 + t for t in range(tokens)], tokens // CHUNK_TOKENS)
            items = []
            for c, h in enumerate(hashes):
                chunk = kv[:, :, c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]
                for g, layers in enumerate(addresses.groups):
                    key = addresses.key(h, g)
                    items.append((key, encode_chunk(chunk[layers.start : layers.stop], get_codec(codec), key=key)))
            far.put_many(items)
            stored += sum(len(v) for _, v in items)
            all_hashes.append(hashes)
    return addresses, all_hashes, stored


def _warm_up(far_url: str, addresses: Any, hashes: list[list[str]]) -> None:
    """Decode one object first: the codec's JIT kernels compile once, outside any measured load."""
    from storage import open_store
    from vllm_kvcodec.format import decode_chunk

    with open_store(far_url) as far:
        key = addresses.key(hashes[0][0], 0)
        decode_chunk(far.get(key), key=key)


class Engine:
    """One engine's load path: paged caches for one prefix, a fetcher, its own store handle."""

    def __init__(self, store_url: str, addresses: Any, tokens: int, kv: torch.Tensor, fetch_threads: int) -> None:
        from storage import open_store
        from vllm_kvcodec.load.fetcher import Fetcher
        from vllm_kvcodec.paged import layout_for
        from vllm_kvcodec.stats import ConnectorStats

        layers, _, _, heads, dim = kv.shape
        blocks = tokens // BLOCK_SIZE
        self.caches = [torch.zeros((blocks, heads, BLOCK_SIZE, 2 * dim), dtype=kv.dtype) for _ in range(layers)]
        self.layout = layout_for("CPU_ATTN", self.caches[0], block_size=BLOCK_SIZE, head_size=dim, num_kv_heads=heads)
        self.block_ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
        self.slots = (self.block_ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1)
        self.store = open_store(store_url)
        self.stats = ConnectorStats()
        self.fetcher = Fetcher(self.store, addresses, self.caches, [self.layout] * layers, fetch_threads, self.stats)
        self.seconds: list[float] = []
        self.exact = True

    def load(self, hashes: list[str], source: torch.Tensor, check: bool) -> None:
        from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
        from vllm_kvcodec.plans.spans import Span

        per = CHUNK_TOKENS // BLOCK_SIZE
        chunks = [ChunkLoad(h, [Span(0, self.slots[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS].tolist())],
                            self.block_ids[c * per : (c + 1) * per].tolist()) for c, h in enumerate(hashes)]
        t0 = time.perf_counter()
        job = self.fetcher.submit([LoadSpec(uuid.uuid4().hex, chunks, False)], timeout_s=600)
        job.done.wait()
        self.seconds.append(time.perf_counter() - t0)
        if job.failed_blocks:
            self.exact = False
        elif check:
            for layer, cache in enumerate(self.caches):
                got = self.layout.gather(cache, self.slots)
                if not torch.equal(got.view(torch.int16), source[layer].view(torch.int16)):
                    self.exact = False

    def far_bytes(self) -> int:
        """Bytes this engine read from the far store: its near tier's count, or (no near tier) all it loaded."""
        counters = getattr(self.store, "tier_counters", None)
        return counters()["far_read_bytes"] if counters else int(self.stats.totals().get("loaded_bytes", 0))

    def close(self) -> None:
        self.fetcher.shutdown()
        self.store.close()


def _summarize(label: str, fleet: list[Engine]) -> dict[str, Any]:
    seconds = sorted(s for engine in fleet for s in engine.seconds)
    far = sum(engine.far_bytes() for engine in fleet)
    counters = [engine.store.tier_counters() for engine in fleet if hasattr(engine.store, "tier_counters")]
    return {"config": label, "engines": len(fleet), "loads": len(seconds),
            "load_p50_ms": 1000 * statistics.median(seconds),
            "load_p99_ms": 1000 * seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))],
            "load_mean_ms": 1000 * statistics.fmean(seconds),
            "far_read_bytes": far, "far_read_bytes_per_request": far / len(seconds),
            "bit_exact": all(engine.exact for engine in fleet),
            "tier_counters": {k: sum(c[k] for c in counters) for k in counters[0]} if counters else None}


def _interleaved(configs: dict[str, Any], addresses: Any, hashes: list[list[str]], prefixes: list[torch.Tensor],
                 engines: int, rounds: int, fetch_threads: int, seed: int) -> list[dict[str, Any]]:
    """Every configuration's fleet serves the same schedule, one load of each in turn (A/B interleaved, so the
    shared host's drift falls on both alike): round by round, engine by engine, each engine's own shuffled order."""
    tokens = prefixes[0].shape[2]
    fleets = {label: [Engine(url_for(e), addresses, tokens, prefixes[0], fetch_threads) for e in range(engines)]
              for label, url_for in configs.items()}
    labels = list(fleets)
    step = 0
    for r in range(rounds):
        for e in range(engines):
            for p in random.Random(seed * 1000 + r * 10 + e).sample(range(len(prefixes)), len(prefixes)):
                turn = labels if step % 2 == 0 else labels[::-1]
                for label in turn:
                    fleets[label][e].load(hashes[p], prefixes[p], check=step % 3 == 0 or r == rounds - 1)
                step += 1
    out = [_summarize(label, fleet) for label, fleet in fleets.items()]
    for fleet in fleets.values():
        for engine in fleet:
            engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--codec", default="rans")
    parser.add_argument("--gbps", type=float, default=1.0)
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--fetch-threads", type=int, default=4)
    parser.add_argument("--near-bytes", default="1GiB")
    parser.add_argument("--redis-url", default=None, help="a running Redis (default: start a private redis-server)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/near_tier_fleet.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    from storage.testing.redis_server import start_redis_server

    server = None if args.redis_url else start_redis_server()
    redis_url = args.redis_url or server.url
    try:
        t0 = time.perf_counter()
        prefixes = _prefixes(args.prefixes, args.tokens)
        link = f"gbps={args.gbps:g}&rtt_ms={args.rtt_ms:g}"
        prefix = f"bench-near/{uuid.uuid4().hex[:8]}/"
        far = f"link+{redis_url}?{link}&prefix={prefix}"
        addresses, hashes, stored = _save(far, prefixes, args.codec)
        run = uuid.uuid4().hex[:8]
        configs = {
            "far only": lambda e: far,
            "near tier": lambda e: f"cache+{far}&near=memory://fleet-{run}-{e}&near_bytes={args.near_bytes}",
        }
        _warm_up(far, addresses, hashes)
        print(f"saved {stored / 2**20:.1f} MiB in {time.perf_counter() - t0:.0f} s; loading", flush=True)
        results = _interleaved(configs, addresses, hashes, prefixes, args.engines, args.rounds, args.fetch_threads, 7)
        for r in results:
            label = r["config"]
            print(f"{label:10s}: {r['loads']} loads, load p50 {r['load_p50_ms']:.0f} ms, p99 {r['load_p99_ms']:.0f} ms, "
                  f"far bytes/request {r['far_read_bytes_per_request'] / 2**20:.2f} MiB, far total "
                  f"{r['far_read_bytes'] / 2**20:.1f} MiB, bit-exact {r['bit_exact']}", flush=True)
    finally:
        if server is not None:
            server.stop()
    result = {"benchmark": "near_tier_fleet", "args": {k: str(v) for k, v in vars(args).items()},
              "stored_bytes": stored, "prefix_raw_bytes": prefixes[0].numel() * 2, "results": results,
              "note": "one shared 2-core host; seconds are noisy, byte counts exact"}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
