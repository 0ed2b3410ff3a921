"""vLLM's router (``vllm-router``, the PyPI wheel's Rust binary) in a subprocess: found, started, waited for, stopped.

It comes with the project's ``router`` extra (``pip install
'vllm-kvcodec[router]'``; ``make install`` includes it). Started in its own
session on a free loopback port once its workers answer, stopped by its pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from storage.testing.ports import reserved_port
from vllm_kvcodec.tools.server_process import Server, stop, wait_answering

MISSING = "vllm-router is not installed: pip install 'vllm-kvcodec[router]' (make install includes it)"


def find_router() -> str | None:
    """The ``vllm-router`` executable: beside this Python (a venv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("vllm-router")


@contextlib.contextmanager
def running_router(worker_urls: Sequence[str], policy: str, log_path: Path, extra: Sequence[str] = (),
                   start_timeout: float = 120.0) -> Iterator[Server]:
    """``vllm-router --worker-urls ... --policy P [extra]`` until /readiness answers; stopped on exit."""
    exe = find_router()
    if exe is None:
        raise RuntimeError(MISSING)
    # Its own Prometheus metrics on a port of its own: the default port would clash between two routers.
    port, metrics_port = reserved_port(), reserved_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--worker-urls", *worker_urls, "--policy", policy, *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Server(proc, port, log_path)
    try:
        wait_answering(router, start_timeout, "/readiness", "vllm-router", owned=False)
        yield router
    finally:
        stop(router)
