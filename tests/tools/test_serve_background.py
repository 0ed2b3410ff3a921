"""A real ``kvcodec serve`` whose saves land after its answers: /metrics while they land, and SIGTERM before.

The server stores into a real Redis whose writes are paused (``CLIENT PAUSE
... WRITE``: reads, so lookups, go on) while a request runs, so its three
chunk saves wait in the store's client after its answer, when vLLM's engine
has nothing left to compute. The first request's saves must reach /metrics
once the writes resume, while no other request comes (vLLM steps the idle
engine for them: ``has_pending_push_work``). The second request's saves are
still waiting when the server gets SIGTERM, and the writes resume only after
it: they must all be in Redis once it has stopped, counted by the connector's
shutdown line.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.redis_server import short_lived_redis_server
from tests.support.vllm_server import ENGINE_ARGS, SERVED_NAME, Server, running, server_env

pytestmark = pytest.mark.engine

CHUNK = 256
FULL_CHUNKS = 3
#: Three whole chunks each, and a tail below one block (128): nothing else is stored.
FIRST = list(range(1000, 1000 + FULL_CHUNKS * CHUNK + 20))
SECOND = list(range(9000, 9000 + FULL_CHUNKS * CHUNK + 20))
#: Writes wait in Redis while it is paused: a read timeout longer than any pause here.
STORE_OPTIONS = "read_timeout=120"


def model() -> str:
    from vllm_kvcodec.tools.smollm2 import model_dir

    return str(model_dir())


def redis_call(url: str, *command: str) -> Any:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def stored_chunks(redis_url: str) -> int:
    """Chunks with an object in Redis, from their keys (``kvc/<namespace>/<chain>/r<rank>g<group>``; refs end in
    ``/ref``)."""
    from storage import open_store

    with open_store(redis_url, read_only=True) as store:
        return len({tuple(k.split("/")[1:3]) for k in store.keys("kvc/") if not k.endswith("/ref")})


def saved_chunks(server: Server) -> float:
    want = frozenset({("model_name", SERVED_NAME), ("engine", "0")})
    return server.metrics().get(("vllm:kvcodec_saved_chunks_total", want), 0.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Writes paused: one request; writes resumed, /metrics polled until its saves show (or 120 s). Writes paused:
    a second request, SIGTERM, writes resumed a second later."""
    tmp = tmp_path_factory.mktemp("serve-background")
    with short_lived_redis_server() as redis:
        argv = ["-m", "vllm_kvcodec.tools.cli", "serve", model(), "--store", f"{redis.url}?{STORE_OPTIONS}",
                *ENGINE_ARGS]
        out: dict[str, Any] = {}
        with running(argv, tmp / "server.log", server_env()) as server:
            redis_call(redis.url, "CLIENT", "PAUSE", "100000", "WRITE")
            server.complete(FIRST)
            out["before_writes"] = saved_chunks(server)
            redis_call(redis.url, "CLIENT", "UNPAUSE")
            seen, deadline = [], time.monotonic() + 120
            while time.monotonic() < deadline and (not seen or seen[-1] < FULL_CHUNKS):
                time.sleep(0.5)
                seen.append(saved_chunks(server))
            out["seen"] = seen
            out["completions"] = server.metrics().get(("http_request_size_bytes_count",
                                                       frozenset({("handler", "/v1/completions")})))
            redis_call(redis.url, "CLIENT", "PAUSE", "100000", "WRITE")
            server.complete(SECOND)
            out["at_sigterm"] = stored_chunks(redis.url)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            redis_call(redis.url, "CLIENT", "UNPAUSE")
            server.proc.wait(90)
            out["log"] = server.log()
        out["after"] = stored_chunks(redis.url)
        yield out


def test_saves_that_land_after_the_last_request_reach_metrics(served: dict[str, Any]) -> None:
    seen = served["seen"]
    assert served["before_writes"] == 0 and served["completions"] == 1  # nothing stepped the engine but the saves
    assert seen[-1] == FULL_CHUNKS, f"/metrics stayed at {seen[-1]} saved chunks of {FULL_CHUNKS} (polled: {seen})"


def test_sigterm_with_saves_queued_stores_them_and_counts_them(served: dict[str, Any]) -> None:
    log = served["log"]
    assert served["at_sigterm"] == FULL_CHUNKS  # the first request's: the second's waited for the writes
    assert served["after"] == 2 * FULL_CHUNKS, log[-3000:]
    line = re.search(r"kvcodec: shutdown: stored the (\d+) chunk save\(s\) still queued when the engine stopped "
                     r"computing \((\d+) before shutdown, (\d+) at shutdown", log)
    assert line and int(line.group(1)) == FULL_CHUNKS, line.group(0) if line else log[-3000:]
    assert "not stored within" not in log
