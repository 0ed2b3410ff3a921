"""vllm-router's kv_aware policy weighs the connector's BlockStored events as its External tier, not as GPU blocks.

The events are the real ones: made by vLLM's real Scheduler with the
connector (tests/support/scheduler_harness.py), its own GPU events and the
connector's store events, and published over ZMQ to the real router binary
(the PyPI wheel, the project's ``router`` extra). Two stand-in workers answer
the router's requests with their own name, so the request's worker says how
the router scored them: worker 1 announces 3 of the prompt's 4 blocks in its
GPU (48 tokens of credit), worker 2 all 4 in the store. As External blocks
(``--kv-penalty-external``, 0.6 by default) those are worth 38 tokens and
worker 1 wins; taken for GPU blocks (what the router does with an unknown
medium and no ownership) they would be worth 64 and worker 2 would.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from storage.testing.ports import reserved_port
from tests.connector.test_kv_events import make, settle, turn_on_vllm_kv_events
from tests.support.scheduler_harness import prompt
from vllm_kvcodec.tools.router_process import find_router, running_router

pytestmark = [pytest.mark.skipif(find_router() is None, reason="vllm-router is not installed (the router extra)"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

BLOCK = 16  # the harness's block size in test_kv_events (chunks of 2 blocks)


class _Named(http.server.BaseHTTPRequestHandler):
    """A worker as the router sees it: healthy, one model, and completions that answer with its name."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = {"object": "list", "data": [{"id": "m", "object": "model"}]} if self.path == "/v1/models" else {}
        self._json(body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._json({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                    "choices": [{"text": self.server.name, "index": 0, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def workers() -> Iterator[list[str]]:
    servers = []
    for name in ("w1", "w2"):
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Named)
        s.name = name
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture
def events(tmp_path, monkeypatch) -> tuple[list[int], list[Any], list[Any]]:
    """A 64-token prompt's events: vLLM's GPU BlockStored and the connector's store BlockStored (two chunks)."""
    turn_on_vllm_kv_events(monkeypatch)
    tokens = prompt(64 + 8)
    e, rec = make(tmp_path, f"file://{tmp_path / 'store'}")
    e.add("a", tokens, max_tokens=1)
    e.run()
    settle(e)
    e.shutdown()
    gpu = [ev for ev in rec.events if type(ev).__name__ == "BlockStored" and ev.medium == "GPU"]
    store = rec.of("BlockStored")
    assert len(store) == 2 and len(gpu) >= 1
    return tokens, gpu, store


def _first_blocks(gpu: list[Any], n: int) -> Any:
    """vLLM's GPU event for the prompt's first ``n`` blocks (its events cover them in order)."""
    hashes = [h for ev in gpu for h in ev.block_hashes]
    tokens = [t for ev in gpu for t in ev.token_ids]
    return msgspec.structs.replace(gpu[0], block_hashes=hashes[:n], token_ids=tokens[: n * BLOCK])


def _route(tmp_path, workers: list[str], tokens: list[int], w1_events: list[Any], w2_events: list[Any],
           extra: tuple[str, ...] = ()) -> str:
    """Start kv_aware on ZMQ sources, publish each worker's events, and ask where the prompt goes."""
    import zmq

    from vllm.distributed.kv_events import KVEventBatch
    from vllm_kvcodec.tools.smollm2 import model_dir

    ctx = zmq.Context()
    pubs, endpoints = [], []
    for _ in workers:
        sock = ctx.socket(zmq.PUB)
        endpoint = f"tcp://127.0.0.1:{reserved_port()}"
        sock.bind(endpoint)
        pubs.append(sock)
        endpoints.append(endpoint)
    args = [a for url, ep in zip(workers, endpoints) for a in ("--kv-event-source", f"{url}={ep}")]
    args += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model_dir()), *extra]
    try:
        with running_router(workers, "kv_aware", tmp_path / "router.log", args) as router:
            enc = msgspec.msgpack.Encoder()
            for seq in range(3):  # a PUB drops what it sends before the router's SUB has joined: send again
                for sock, evs in zip(pubs, (w1_events, w2_events)):
                    sock.send_multipart([b"", seq.to_bytes(8, "big"), enc.encode(KVEventBatch(ts=time.time(), events=evs))])
                time.sleep(0.7)
            body = json.dumps({"model": "m", "prompt": tokens, "max_tokens": 1}).encode()
            request = urllib.request.Request(router.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as resp:
                return json.loads(resp.read())["choices"][0]["text"]
    finally:
        for sock in pubs:
            sock.close(linger=0)
        ctx.term()


def test_store_blocks_count_as_the_external_tier(tmp_path, workers, events) -> None:
    tokens, gpu, store = events
    three_in_gpu = _first_blocks(gpu, 3)
    assert _route(tmp_path, workers, tokens, [three_in_gpu], store) == "w1"  # 48 > 4 x 16 x 0.6
    # the credit is the router's flag: at 1.0 the store's 4 blocks outweigh the GPU's 3
    assert _route(tmp_path, workers, tokens, [three_in_gpu], store, ("--kv-penalty-external", "1.0")) == "w2"


def test_without_an_ownership_the_router_takes_store_blocks_for_gpu_blocks(tmp_path, workers, events) -> None:
    """Why the connector sets one: the same events with kv_events_ownership null are scored as GPU blocks."""
    tokens, gpu, store = events
    bare = [msgspec.structs.replace(ev, ownership=None) for ev in store]
    assert _route(tmp_path, workers, tokens, [_first_blocks(gpu, 3)], bare) == "w2"
