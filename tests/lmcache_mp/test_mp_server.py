"""LMCache's MP server process on the CPU, with a kvcodec serde, driven through LMCache's own client API.

The server is started as a user would (``lmcache server ...``, or our launcher
``python -m vllm_kvcodec.lmcache_mp.server ...`` when only LMCache's adapters are
listed). The client side is LMCache's vLLM integration without vLLM: its
``LMCacheMPWorkerAdapter`` registers CPU paged KV caches (POSIX shared memory),
stores a 256-token prefix, the server's L1 is cleared over its HTTP API, the
``LMCacheMPSchedulerAdapter`` looks the prefix up (which prefetches it from L2
through the serde), and the worker retrieves it into zeroed pages: bit-exact.
Client processes must ask for ``lmcache_driven`` transfer on the CPU
(``LMCACHE_MP_TRANSFER_MODE``); the default would pick engine-driven, which the
server does not offer there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp, ParallelStrategy,
)

from storage.testing.ports import reserved_port
from storage.testing.processes import terminate
from tests.lmcache_mp.harness import plugin_adapter

BLOCK = 16
MODEL = "smollm2-135m"


def paged(chunk: torch.Tensor) -> dict[str, torch.Tensor]:
    """A canonical ``[layers, 2, 256, heads, dim]`` chunk as vLLM's per-layer paged caches ``[2, blocks, 16, heads, dim]``."""
    layers, _, tokens, heads, dim = chunk.shape
    return {f"model.layers.{i}.self_attn.attn": chunk[i].reshape(2, tokens // BLOCK, BLOCK, heads, dim).clone()
            for i in range(layers)}


def start_server(adapter: dict, *, launcher: bool, log: Path) -> tuple[subprocess.Popen, int, int]:
    port, http_port = reserved_port(), reserved_port()
    entry = ["-m", "vllm_kvcodec.lmcache_mp.server"] if launcher else ["-m", "lmcache.cli.main", "server"]
    cmd = [sys.executable, "-W", "ignore", *entry, "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
           "--chunk-size", "256", "--port", str(port), "--http-port", str(http_port),
           "--l2-adapter", json.dumps(adapter)]
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 240  # the server imports a lot; minutes on a loaded 2-core box
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"LMCache server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck", timeout=2)
            return proc, port, http_port
        except OSError:
            time.sleep(1)
    terminate(proc, 10)
    raise AssertionError(f"LMCache server never answered its healthcheck:\n{log.read_text()[-3000:]}")


@pytest.fixture
def transfer_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")
    yield


def settled_size(root: Path, quiet_s: float = 1.5) -> int:
    """Bytes under ``root`` once something is there and the total has not changed for ``quiet_s``."""
    deadline, last, since = time.monotonic() + 60, -1, time.monotonic()
    while time.monotonic() < deadline:
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
        if size != last:
            last, since = size, time.monotonic()
        elif size and time.monotonic() - since >= quiet_s:
            return size
        time.sleep(0.1)
    raise AssertionError(f"nothing settled under {root}")


def wait_finished(worker: LMCacheMPWorkerAdapter, request_id: str, retrieve: bool) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stores, retrieves = worker.get_finished({request_id})
        if request_id in ((retrieves if retrieve else stores) or set()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never finished")


@pytest.mark.parametrize("setup", ["lmcache-fs-via-launcher", "kvcodec-adapter-plain-lmcache"])
def test_store_and_retrieve_through_the_mp_server(
    tmp_path: Path, real_chunks: list[torch.Tensor], transfer_mode: None, setup: str
) -> None:
    if setup == "lmcache-fs-via-launcher":
        adapter = {"type": "fs", "base_path": str(tmp_path / "l2"), "serde": {"type": "kvcodec-zstd", "fixed_ratio": 1.3}}
    else:
        adapter = plugin_adapter(f"file://{tmp_path / 'l2'}", {"type": "kvcodec-rans"})
    proc, port, http_port = start_server(adapter, launcher=setup.endswith("launcher"), log=tmp_path / "server.log")
    try:
        chunk = real_chunks[0]
        caches = paged(chunk)
        want = {name: t.clone() for name, t in caches.items()}
        strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
                                    n_servers=1)
        url = f"tcp://127.0.0.1:{port}"
        worker = LMCacheMPWorkerAdapter(url, zmq.Context(), MODEL, BLOCK, strategy)
        worker.register_kv_caches(caches, layout_hints={"kv_layout": "NHD"})
        tokens = list(range(5000, 5256))
        op = LoadStoreOp(token_ids=tokens, block_ids=[list(range(256 // BLOCK))], start=0, end=256)
        worker.submit_store_request("store-1", op, worker.create_recorded_event())
        wait_finished(worker, "store-1", retrieve=False)

        l2 = tmp_path / "l2"
        stored = settled_size(l2)  # the store controller writes L1 -> L2 behind the store's completion
        raw = chunk.numel() * chunk.element_size()
        print(f"{setup}: {stored} bytes in L2 for {raw} bytes of KV (ratio {raw / stored:.3f})")
        assert 0 < stored < raw / 1.25

        clear = urllib.request.Request(f"http://127.0.0.1:{http_port}/cache/clear", method="POST")
        assert json.loads(urllib.request.urlopen(clear, timeout=30).read())["status"] == "ok"
        for t in caches.values():
            t.zero_()

        scheduler = LMCacheMPSchedulerAdapter([url], zmq.Context(), MODEL, BLOCK, strategy)
        scheduler.maybe_submit_lookup_request("load-1", tokens)
        deadline = time.monotonic() + 60
        matched = None
        while matched is None and time.monotonic() < deadline:
            matched = scheduler.check_lookup_result("load-1")
            time.sleep(0.05)
        assert matched == 256  # found in L2 only (L1 was cleared), prefetched through the serde

        worker.submit_retrieve_request("load-1", op, worker.create_recorded_event())
        wait_finished(worker, "load-1", retrieve=True)
        assert worker.get_block_ids_with_load_errors() == set()
        assert all(torch.equal(caches[n].view(torch.int16), want[n].view(torch.int16)) for n in caches)
        scheduler.shutdown()
        worker.shutdown()
    finally:
        terminate(proc, 20)
