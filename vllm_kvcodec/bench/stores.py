"""Put/get throughput of the file and Redis stores for chunk-sized objects.

Why these cells: a stored object is one chunk x one layer group, 1-16 MiB
depending on model and chunk size; the fetcher reads them one at a time or in
batches (``get_many``), so both are measured. Figures are MB/s (10^6 bytes) of
value bytes, one thread, best of three rounds after a warm-up object. The file store runs in
the system temp directory, so gets are served from the page cache: that is what
a recently written local store looks like, not a cold disk. Redis runs on
loopback (a temporary redis-server when no URL is given), so its figures are the
protocol and copy cost with no network in the way.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.progress import Progress

from storage import Store, open_store
from storage.options import redact_url
from storage.redis_server import find_redis_server, start_redis_server
from vllm_kvcodec.bench.report import console, machine, table, write_json

MiB = 1 << 20
SIZES_MIB = (1, 4, 16)
BATCH = 8
BYTES_PER_CELL = 64 * MiB
REPEATS = 3
MODES = ("single", "batched")


def run(output: Path | None = None, redis_url: str | None = None) -> dict[str, Any]:
    """Measure every store x object size x mode; print a table, write JSON to ``output``."""
    with ExitStack() as stack:
        targets = _targets(stack, redis_url)
        rows = _measure_all(targets)
    result = {
        "machine": machine(),
        "unit": "MB/s (1e6 bytes/s) of value bytes, one thread",
        "batch": BATCH,
        "repeats": REPEATS,
        "bytes_per_cell": BYTES_PER_CELL,
        "stores": {name: redact_url(url) for name, url in targets.items()},
        "results": rows,
    }
    _print(result)
    write_json(result, output)
    return result


def _targets(stack: ExitStack, redis_url: str | None) -> dict[str, str]:
    """The stores to measure; Redis only where a server is given or one can be started."""
    root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcodec-bench-"))
    targets = {"file": f"file://{root}"}
    if redis_url is None and find_redis_server() is not None:
        redis_url = stack.enter_context(start_redis_server()).url
    if redis_url is None:
        console.print("[yellow]redis-server not on PATH and no redis_url given: Redis is not measured[/yellow]")
    else:
        sep = "&" if "?" in redis_url else "?"
        targets["redis"] = f"{redis_url}{sep}prefix=kvcodec-bench/{uuid.uuid4().hex}/"
    return targets


def _measure_all(targets: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("stores", total=len(targets) * len(SIZES_MIB) * len(MODES))
        for name, url in targets.items():
            with open_store(url) as store:
                for size_mib in SIZES_MIB:
                    payloads = [os.urandom(size_mib * MiB) for _ in range(BATCH)]
                    for mode in MODES:
                        progress.update(task, description=f"{name} {size_mib} MiB {mode}")
                        cell = _cell(store, payloads, mode)
                        rows.append({"store": name, "object_MiB": size_mib, "mode": mode, **cell})
                        progress.advance(task)
    return rows


def _cell(store: Store, payloads: list[bytes], mode: str) -> dict[str, float]:
    """Best of ``REPEATS`` rounds of putting, getting and deleting ``BYTES_PER_CELL`` of objects.

    Best-of, because page-cache writeback and the scheduler add noise of tens of
    percent to a single round on a small machine.
    """
    size = len(payloads[0])
    count = max(BATCH, BYTES_PER_CELL // size // BATCH * BATCH)
    keys = [f"bench/{mode}/{size}/{i}" for i in range(count)]
    store.put("bench/warmup", payloads[0])
    store.get("bench/warmup")
    store.delete("bench/warmup")
    put_s, get_s = zip(*(_round(store, keys, payloads, mode) for _ in range(REPEATS)))
    total = count * size
    return {"objects": count, "put_MBps": total / min(put_s) / 1e6, "get_MBps": total / min(get_s) / 1e6}


def _round(store: Store, keys: list[str], payloads: list[bytes], mode: str) -> tuple[float, float]:
    batches = [keys[i : i + BATCH] for i in range(0, len(keys), BATCH)]
    got: list[bytes | None] = []

    def put() -> None:
        if mode == "single":
            for i, key in enumerate(keys):
                store.put(key, payloads[i % BATCH])
        else:
            for batch in batches:
                store.put_many(zip(batch, payloads))

    def get() -> None:
        if mode == "single":
            got.extend(store.get(key) for key in keys)
        else:
            for batch in batches:
                got.extend(store.get_many(batch))

    put_s, get_s = _timed(put), _timed(get)
    if any(v is None or len(v) != len(payloads[0]) for v in got):
        raise RuntimeError(f"{store!r} lost or resized an object during the benchmark")
    for key in keys:
        store.delete(key)
    return put_s, get_s


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _print(result: dict[str, Any]) -> None:
    rows = [[r["store"], r["object_MiB"], r["mode"], r["put_MBps"], r["get_MBps"]] for r in result["results"]]
    table("store throughput (MB/s, one thread)", ["store", "object MiB", "mode", "put MB/s", "get MB/s"], rows)


if __name__ == "__main__":
    run(Path("bench-results/stores.json"))
