"""Put/get throughput of the file, Redis and Mooncake stores for chunk-sized objects.

Why these cells: a stored object is one chunk x one layer group, 1-16 MiB
depending on model and chunk size; the fetcher reads them one at a time or in
batches (``get_many``), from several threads, so all of those are measured.
Figures are MB/s (10^6 bytes) of value bytes summed over the threads, best of
three rounds after a warm-up object. The file store runs in the system temp
directory, so gets are served from the page cache: that is what a recently
written local store looks like, not a cold disk. Redis and Mooncake run on
loopback (a temporary redis-server, and a temporary Mooncake pool of a master
and two nodes, when no URL is given), so their figures are the protocol and copy
cost with no network in the way.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.progress import Progress

from storage import Store, open_store
from storage.options import redact_url
from storage.testing.mooncake_server import MooncakeServerError, find_mooncake, start_mooncake_pool
from storage.testing.redis_server import find_redis_server, start_redis_server
from vllm_kvcodec.tools.bench.report import console, machine, table, write_json

MiB = 1 << 20
SIZES_MIB = (1, 4, 16)
BATCH = 8
BYTES_PER_CELL = 64 * MiB
REPEATS = 3
MODES = ("single", "batched")
THREADS = (1, 4)
# A temporary Mooncake pool: two nodes holding the largest cell (4 threads x 8 x 16 MiB) twice over, and client
# buffers for four threads' batches in flight at once.
MOONCAKE_NODE_BYTES = 512 * MiB
MOONCAKE_BUFFER = "640MiB"


def run(
    output: Path | None = None,
    redis_url: str | None = None,
    mooncake_url: str | None = None,
    threads: tuple[int, ...] = THREADS,
) -> dict[str, Any]:
    """Measure every store x object size x mode x thread count; print a table, write JSON to ``output``."""
    with ExitStack() as stack:
        targets = _targets(stack, redis_url, mooncake_url)
        rows = _measure_all(targets, threads)
    result = {
        "machine": machine(),
        "unit": "MB/s (1e6 bytes/s) of value bytes, summed over the threads",
        "batch": BATCH,
        "repeats": REPEATS,
        "bytes_per_cell": BYTES_PER_CELL,
        "stores": {name: redact_url(url) for name, url in targets.items()},
        "results": rows,
    }
    _print(result)
    write_json(result, output)
    return result


def _targets(stack: ExitStack, redis_url: str | None, mooncake_url: str | None) -> dict[str, str]:
    """The stores to measure; Redis and Mooncake only where one is given or can be started."""
    root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcodec-bench-"))
    targets = {"file": f"file://{root}"}
    if redis_url is None and find_redis_server() is not None:
        redis_url = stack.enter_context(start_redis_server()).url
    if redis_url is None:
        console.print("[yellow]redis-server not on PATH and no redis_url given: Redis is not measured[/yellow]")
    else:
        targets["redis"] = _with_prefix(redis_url)
    if mooncake_url is None and find_mooncake() is not None:
        try:
            pool = stack.enter_context(start_mooncake_pool(nodes=2, segment_bytes=MOONCAKE_NODE_BYTES))
            mooncake_url = pool.url(buffer=MOONCAKE_BUFFER)
        except MooncakeServerError as exc:
            console.print(f"[yellow]a temporary Mooncake pool did not start ({exc})[/yellow]")
    if mooncake_url is None:
        console.print("[yellow]Mooncake not installed and no mooncake_url given: Mooncake is not measured[/yellow]")
    else:
        targets["mooncake"] = _with_prefix(mooncake_url)
    return targets


def _with_prefix(url: str) -> str:
    """``url`` with a key prefix of this run's own, so a shared server's other keys are never touched."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}prefix=kvcodec-bench/{uuid.uuid4().hex}/"


def _measure_all(targets: dict[str, str], threads: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("stores", total=len(targets) * len(SIZES_MIB) * len(MODES) * len(threads))
        for name, url in targets.items():
            with open_store(url) as store:
                for size_mib in SIZES_MIB:
                    payloads = [os.urandom(size_mib * MiB) for _ in range(BATCH)]
                    for mode in MODES:
                        for n in threads:
                            progress.update(task, description=f"{name} {size_mib} MiB {mode} x{n}")
                            cell = _cell(store, payloads, mode, n)
                            rows.append({"store": name, "object_MiB": size_mib, "mode": mode, "threads": n, **cell})
                            progress.advance(task)
    return rows


def _cell(store: Store, payloads: list[bytes], mode: str, threads: int) -> dict[str, float]:
    """Best of ``REPEATS`` rounds of putting, getting and deleting ``BYTES_PER_CELL`` of objects.

    Best-of, because page-cache writeback and the scheduler add noise of tens of
    percent to a single round on a small machine.
    """
    size = len(payloads[0])
    count = max(BATCH * threads, BYTES_PER_CELL // size // (BATCH * threads) * BATCH * threads)
    keys = [f"bench/{mode}/{size}/{i}" for i in range(count)]
    store.put("bench/warmup", payloads[0])
    store.get("bench/warmup")
    store.delete("bench/warmup")
    put_s, get_s = zip(*(_round(store, keys, payloads, mode, threads) for _ in range(REPEATS)))
    total = count * size
    return {"objects": count, "put_MBps": total / min(put_s) / 1e6, "get_MBps": total / min(get_s) / 1e6}


def _round(store: Store, keys: list[str], payloads: list[bytes], mode: str, threads: int) -> tuple[float, float]:
    """Put, then get, every key, each thread taking its own share of the batches."""
    batches = [keys[i : i + BATCH] for i in range(0, len(keys), BATCH)]
    shares = [batches[t::threads] for t in range(threads)]

    def put(share: list[list[str]]) -> None:
        for batch in share:
            if mode == "single":
                for key, payload in zip(batch, payloads):
                    store.put(key, payload)
            else:
                store.put_many(zip(batch, payloads))

    def get(share: list[list[str]]) -> list[bytes | None]:
        if mode == "single":
            return [store.get(key) for batch in share for key in batch]
        return [value for batch in share for value in store.get_many(batch)]

    with ThreadPoolExecutor(threads) as pool:
        put_s = _timed(lambda: list(pool.map(put, shares)))
        got: list[list[bytes | None]] = []
        get_s = _timed(lambda: got.extend(pool.map(get, shares)))
    if any(v is None or len(v) != len(payloads[0]) for share in got for v in share):
        raise RuntimeError(f"{store!r} lost or resized an object during the benchmark")
    for key in keys:
        store.delete(key)
    return put_s, get_s


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _print(result: dict[str, Any]) -> None:
    rows = [
        [r["store"], r["object_MiB"], r["mode"], r["threads"], r["put_MBps"], r["get_MBps"]] for r in result["results"]
    ]
    columns = ["store", "object MiB", "mode", "threads", "put MB/s", "get MB/s"]
    table("store throughput (MB/s, all threads together)", columns, rows)


if __name__ == "__main__":
    run(Path("bench-results/stores.json"))
