"""Loads through a faulty store: every load bit-exact or reported failed, never silently wrong.

Drives the connector's own load path (:class:`~vllm_kvcodec.load.fetcher.Fetcher`,
:class:`~vllm_kvcodec.load.load_job.LoadJob`, the CPU_ATTN paged scatter) on real
SmolLM2 KV, without an engine, so a thousand faulty loads take a minute on two
cores instead of hours. Chunks are saved through the real
:class:`~vllm_kvcodec.save.saver.Saver` (key-bound, ``rans``) into a store behind
:class:`storage.testing.faults.FaultInjector`. Then, until ``faulty_loads`` loads have
met at least one fault, one chunk at a time is loaded into a few reused
blocks of 30 paged layer caches that were first filled with a poison pattern;
the harness waits layer by layer and cancels at the deadline, as the worker
does. A load is then:

- *failed*: the LoadJob reports its blocks, so vLLM would recompute them;
- *exact*: not reported, and the 30 layers gathered back out of paged memory
  equal the chunk bit for bit;
- *wrong*: not reported, but different. The count that must be 0.

Reused blocks and the poison make late writes of cancelled loads visible too:
they would land in blocks a later load reports as exact.

Injected faults (per object read, by kind) are reported next to what the
connector counted (``load_failures``, timeouts), so a fault that went
unnoticed would show up as a gap.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from storage import open_store
from storage.testing.faults import FAULT_KINDS, FaultInjector, find_fault_injector
from vllm_kvcodec.tools.bench.report import console, machine, table, write_json
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses, chunk_hashes
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.paged import CANONICAL_NAMESPACE, CpuAttnVecLayout, Geometry
from vllm_kvcodec.save.saver import Saver
from vllm_kvcodec.stats import ConnectorStats

CHUNK = 128  # tokens per chunk = the block size, so one chunk is one block
LAYERS_PER_OBJECT = 5  # 6 objects per chunk, as the connector's default grouping of 30 layers
TARGET_BLOCKS = 4  # blocks reused by every load
POISON = -0.0  # bf16 0x8000: never present in the real KV at every position, and not equal to +0.0 bitwise
# Per object read; about half the loads (6 reads each) meet a fault, so exact loads are common too.
DEFAULT_RATES = {"drop": 0.02, "truncate": 0.02, "corrupt": 0.03, "delay": 0.005, "swap": 0.03}


def run(
    output: Path | None = None,
    faulty_loads: int = 1000,
    seed: int = 1,
    rates: dict[str, float] | None = None,
    timeout_s: float = 0.25,
    delay_s: float = 0.4,
    tokens: int = 1024,
    threads: int = 4,
    decode_threads: int | None = None,
) -> dict[str, Any]:
    """Load until ``faulty_loads`` loads met a fault; print a table, write JSON to ``output``."""
    from vllm_kvcodec.tools.smollm2 import real_kv

    rates = {**DEFAULT_RATES, **(rates or {})}
    kv = real_kv(tokens)
    chunks = [c.contiguous() for c in kv.split(CHUNK, dim=2)][: tokens // CHUNK]
    query = "&".join(f"{k}={v:g}" for k, v in rates.items())
    url = f"faults+memory://bench-faults-{uuid.uuid4().hex}?seed={seed}&delay_s={delay_s:g}&{query}"
    started = time.perf_counter()
    log = logging.getLogger("vllm_kvcodec")
    level, torch_threads = log.level, torch.get_num_threads()
    log.setLevel(logging.ERROR)  # one warning per failed object would bury the table
    torch.set_num_threads(1)  # the checks are small; OpenMP workers would only fight the fetch threads
    try:
        with open_store(url) as store:
            bench = _Bench(store, find_fault_injector(store), kv, chunks, threads, decode_threads)
            outcome = bench.load_until(faulty_loads, timeout_s, random.Random(seed))
    finally:
        log.setLevel(level)
        torch.set_num_threads(torch_threads)
    result = {
        "machine": machine(),
        "store": "faults+memory://",
        "rates": rates, "seed": seed, "delay_s": delay_s, "load_timeout_s": timeout_s,
        "chunk_tokens": CHUNK, "objects_per_load": len(bench.addresses.groups), "codec": "rans",
        "fetch_threads": threads, "decode_threads": decode_threads,
        "seconds": round(time.perf_counter() - started, 1),
        **outcome,
    }
    _print(result)
    write_json(result, output)
    return result


class _Bench:
    def __init__(self, store, faults: FaultInjector, kv: torch.Tensor, chunks: list[torch.Tensor], threads: int,
                 decode_threads: int | None = None) -> None:
        layers, _, _, heads, head_dim = kv.shape
        namespace = Namespace("bench-faults", "bfloat16", layers, heads, head_dim, CANONICAL_NAMESPACE, 1, CHUNK,
                              LAYERS_PER_OBJECT)
        groups = tuple(range(i, min(i + LAYERS_PER_OBJECT, layers)) for i in range(0, layers, LAYERS_PER_OBJECT))
        self.addresses = ObjectAddresses(namespace, 0, groups)
        self.faults, self.chunks, self.stats = faults, chunks, ConnectorStats()
        self.hashes = chunk_hashes(namespace, list(range(len(chunks) * CHUNK)), len(chunks))
        self.layout = CpuAttnVecLayout(Geometry(heads, head_dim, CHUNK, kv.dtype))
        self.caches = [torch.full((TARGET_BLOCKS, heads, CHUNK, 2 * head_dim), POISON, dtype=kv.dtype)
                       for _ in range(layers)]
        self._save(store)
        self.fetcher = Fetcher(store, self.addresses, self.caches, [self.layout] * layers, threads, self.stats,
                               decode_threads=decode_threads)

    def _save(self, store) -> None:
        saver = Saver(store, self.addresses, CodecChooser("rans"), 2, 1 << 30, ConnectorStats())
        for chunk_hash, chunk in zip(self.hashes, self.chunks):
            saver.submit(chunk_hash, chunk)
        if not saver.flush(300):
            raise RuntimeError("saving the chunks did not finish")
        saver.shutdown()

    def load_until(self, faulty_loads: int, timeout_s: float, rng: random.Random) -> dict[str, Any]:
        counts = {"loads": 0, "faulty_loads": 0, "exact": 0, "failed": 0, "wrong": 0, "timeouts": 0,
                  "failed_without_fault": 0}
        try:
            while counts["faulty_loads"] < faulty_loads:
                before = self.faults.counts()
                c, block = rng.randrange(len(self.chunks)), rng.randrange(TARGET_BLOCKS)
                failed, timed_out = self._load(c, block, timeout_s)
                met_fault = any(self.faults.counts()[k] > before[k] for k in FAULT_KINDS)
                counts["loads"] += 1
                counts["faulty_loads"] += met_fault
                counts["timeouts"] += timed_out
                if failed:
                    counts["failed"] += 1
                    counts["failed_without_fault"] += not met_fault
                elif self._exact(c, block):
                    counts["exact"] += 1
                else:
                    counts["wrong"] += 1
                    console.print(f"[red]WRONG: load {counts['loads']} of chunk {c} into block {block}[/red]")
                self._poison(block)
        finally:
            self.fetcher.shutdown()
        injected = self.faults.counts()
        connector = self.stats.totals()
        return {
            **counts,
            "object_reads": injected.pop("reads"),
            "injected": {k: injected[k] for k in FAULT_KINDS},
            "connector": {"load_failures": int(connector.get("load_failures", 0)), "load_timeouts": counts["timeouts"],
                          "loaded_objects": int(connector.get("loaded_objects", 0))},
        }

    def _load(self, c: int, block: int, timeout_s: float) -> tuple[bool, bool]:
        """One chunk into ``block``, waited for as the worker does; (reported failed, timed out)."""
        slots = list(range(block * CHUNK, (block + 1) * CHUNK))
        job = self.fetcher.submit([LoadSpec("bench", [ChunkLoad(self.hashes[c], [Span(0, slots)], [block])], False)], timeout_s)
        timed_out = not self._wait(job)
        return block in job.failed_blocks, timed_out

    def _wait(self, job: LoadJob) -> bool:
        for layer in range(len(self.caches)):  # wait_for_layer_load, layer by layer
            if not job.wait_layer(layer, job.deadline):
                job.cancel()
                return False
        return True

    def _exact(self, c: int, block: int) -> bool:
        slots = torch.arange(block * CHUNK, (block + 1) * CHUNK)
        for layer, cache in enumerate(self.caches):
            got = self.layout.gather(cache, slots)
            if not torch.equal(got.view(torch.int16), self.chunks[c][layer].view(torch.int16)):
                return False
        return True

    def _poison(self, block: int) -> None:
        for cache in self.caches:
            cache[block].fill_(POISON)


def _print(result: dict[str, Any]) -> None:
    injected, conn = result["injected"], result["connector"]
    table(f"faulty loads: {result['loads']} loads of one {result['chunk_tokens']}-token chunk "
          f"({result['objects_per_load']} objects each), {result['seconds']:.0f} s", ["what", "count"], [
        ["loads", result["loads"]],
        ["loads that met a fault", result["faulty_loads"]],
        ["loads bit-exact", result["exact"]],
        ["loads failed, recomputed", result["failed"]],
        ["  of which timed out", result["timeouts"]],
        ["  of which met no fault (late behind a delayed read)", result["failed_without_fault"]],
        ["loads wrong (must be 0)", result["wrong"]],
        ["object reads", result["object_reads"]],
        *[[f"injected: {k}", injected[k]] for k in FAULT_KINDS],
        ["counted: load_failures (objects)", conn["load_failures"]],
        ["counted: load_timeouts", conn["load_timeouts"]],
    ])
