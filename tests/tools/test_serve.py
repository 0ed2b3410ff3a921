"""Operating the connector inside a real ``vllm serve``: shutdown, /metrics, log lines, the plug-in.

Two servers share one file store. The first is started by ``kvcodec serve``,
answers one request and is stopped with SIGTERM right after it: the prefix's
chunks must be in the store afterwards (their saves were still queued when
the signal came). The second is a plain ``vllm serve`` (vLLM's own CLI) that
names the connector only by ``"kv_connector": "KVCodecConnector"``, found
through the package's ``vllm.general_plugins`` entry point; the same request
loads the prefix, and its /metrics and log show what it did. The second starts while
the first works (each start is mostly one core's imports of vLLM); it is sent
nothing until the first has stopped. A third, on its own, is refused by the
connector: its log must say why in one line.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_server import ENGINE_ARGS, SERVED_NAME, Server, entry_points_dir, running, server_env

pytestmark = pytest.mark.engine

CHUNK = 256
FULL_CHUNKS = 3
PROMPT = list(range(1000, 1000 + FULL_CHUNKS * CHUNK + 20))  # three whole chunks and a tail that is not stored
OTHER = list(range(5000, 5040))  # shorter than a chunk: looked up, nothing to load or save
GROUPS = 1  # a file store into a CPU engine: SmolLM2's 30 layers in one object per chunk (layers_per_object)
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # layers x (K, V) x KV heads x head_dim x bf16


def model() -> str:
    from vllm_kvcodec.tools.smollm2 import model_dir

    return str(model_dir())


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``kvcodec serve``, one request, SIGTERM at once: its store, log and stop time; and the plain ``vllm serve``
    on the same store, started meanwhile and sent nothing yet."""
    tmp = tmp_path_factory.mktemp("serve")
    store = f"file://{tmp / 'store'}"
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        plain = pool.submit(stack.enter_context, plain_server(store, tmp))
        argv = ["-m", "vllm_kvcodec.tools.cli", "serve", model(), "--store", store, *ENGINE_ARGS]
        with running(argv, tmp / "first.log", server_env()) as server:
            server.complete(PROMPT)
            stop_s = server.terminate()
            first = {"store": store, "log": server.log(), "stop_s": stop_s}
        yield {"first": first, "plain": plain}  # its start's future: a failed start fails only the test using it


def plain_server(store: str, tmp: Path) -> contextlib.AbstractContextManager[Server]:
    """vLLM's own CLI, naming the connector only by ``"kv_connector": "KVCodecConnector"`` (no module path)."""
    transfer = {"kv_connector": "KVCodecConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"store": store, "log_interval_s": 1}}
    argv = ["-m", "vllm_kvcodec.tools.vllm_cli", "serve", model(), "--kv-transfer-config", json.dumps(transfer),
            *ENGINE_ARGS]
    env = server_env(PYTHONPATH=f"{entry_points_dir(tmp / 'plugin')}:{server_env()['PYTHONPATH']}")
    return running(argv, tmp / "second.log", env)


def test_sigterm_right_after_a_request_keeps_the_chunks_it_saved(servers: dict[str, Any]) -> None:
    from storage import open_store
    from vllm_kvcodec.tools.store_tools import inspect_store

    first = servers["first"]
    log = first["log"]
    assert "'shutdown_timeout': 20" in log  # set by kvcodec serve, or vLLM would kill the engine at once
    assert re.search(r"kvcodec: shutdown: stored the \d+ chunk save\(s\) still queued", log), log[-3000:]
    with open_store(first["store"], read_only=True) as store:
        summary = inspect_store(store)
    assert len(summary.chunks) == FULL_CHUNKS and summary.objects == FULL_CHUNKS * GROUPS and not summary.damaged
    assert first["stop_s"] < 20


def test_plain_vllm_serve_finds_the_connector_by_name_and_exports_its_metrics(servers: dict[str, Any]) -> None:
    server: Server = servers["plain"].result()
    server.complete(PROMPT)
    time.sleep(1.5)  # past log_interval_s: the next steps log their totals
    server.complete(OTHER)  # so both sides step (and log their totals) again
    metrics = server.metrics()
    log = server.log()
    answered = metrics.get(("http_request_size_bytes_count", frozenset({("handler", "/v1/completions")})))
    assert answered == 2, f"the server answered {answered} completions, not this test's 2 (metrics of other servers?)"
    check_metrics(metrics)
    check_log_lines(log)


def value(metrics: dict, name: str, **labels: str) -> float:
    want = {"model_name": SERVED_NAME, "engine": "0", **labels}
    return metrics.get((name, frozenset(want.items())), float("nan"))


def check_metrics(metrics: dict) -> None:
    """The connector's series, with vLLM's labels, hold what the load of the stored prefix did."""
    stored_tokens = FULL_CHUNKS * CHUNK
    assert value(metrics, "vllm:kvcodec_loaded_tokens_total") == stored_tokens
    assert value(metrics, "vllm:kvcodec_hit_chunks_total") == FULL_CHUNKS
    assert value(metrics, "vllm:kvcodec_hit_tokens_total") == stored_tokens
    assert value(metrics, "vllm:kvcodec_lookups_total") == 2
    assert value(metrics, "vllm:kvcodec_loaded_objects_total") == FULL_CHUNKS * GROUPS
    raw = value(metrics, "vllm:kvcodec_loaded_raw_bytes_total")
    assert raw == stored_tokens * KV_BYTES_PER_TOKEN
    assert 0 < value(metrics, "vllm:kvcodec_loaded_bytes_total") < raw  # compressed
    for kind in ("missing", "corrupt", "mismatch", "store", "timeout", "other"):
        assert value(metrics, "vllm:kvcodec_load_failures_total", kind=kind) == 0
    assert value(metrics, "vllm:kvcodec_load_seconds_count") == 1  # one request loaded
    assert value(metrics, "vllm:kvcodec_load_seconds_sum") > 0
    # one fetch per batch (each object holds 5.9 MB of raw KV, so one fills an 8 MiB batch), and one decode
    # and one scatter per object
    objects = FULL_CHUNKS * GROUPS
    for stage, count in (("fetch", objects), ("decode", objects), ("scatter", objects)):
        assert value(metrics, f"vllm:kvcodec_{stage}_seconds_count") == count
        assert value(metrics, f"vllm:kvcodec_{stage}_seconds_bucket", le="+Inf") == count


def check_log_lines(log: str) -> None:
    """The start-up line and the periodic totals of both sides show with vLLM's default logging."""
    assert "Creating v1 connector with name: KVCodecConnector" in log
    assert re.search(r"INFO .*kvcodec: 30 KV layers, 30 per stored object", log), log[-3000:]
    assert re.search(r"INFO .*kvcodec scheduler: .*hit_chunks=3", log), log[-3000:]
    assert re.search(r"INFO .*kvcodec worker: .*loaded_tokens=768", log), log[-3000:]


def test_plain_vllm_serve_logs_why_the_connector_refuses_to_start_in_one_error_line(tmp_path: Path) -> None:
    """vLLM answers a connector's refusal with pages of traceback from several processes; the cause and the fix
    stand in an ERROR line of the connector's own, logged before it raised."""
    import subprocess
    import sys

    from tests.support.vllm_server import ROOT, free_port

    transfer = {"kv_connector": "KVCodecConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"store": f"file://{tmp_path / 'store'}", "chunk_size": 320}}
    argv = [sys.executable, "-m", "vllm_kvcodec.tools.vllm_cli", "serve", model(), "--kv-transfer-config",
            json.dumps(transfer), *ENGINE_ARGS, "--port", str(free_port())]  # ENGINE_ARGS: --block-size 128
    env = server_env(PYTHONPATH=f"{entry_points_dir(tmp_path / 'plugin')}:{server_env()['PYTHONPATH']}")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if "kvcodec: refusing to start" in line]
    assert lines, output[-3000:]
    assert all(re.search(r"ERROR \d\d-\d\d .*\] kvcodec: refusing to start: chunk_size 320 must be a multiple of "
                         r"vLLM's block_size 128; use chunk_size 256 or 384$", line) for line in lines), lines
