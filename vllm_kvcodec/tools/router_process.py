"""vLLM's router (``vllm-router``, the PyPI wheel's Rust binary) in a subprocess: found, started, waited for, stopped.

It comes with the project's ``router`` extra (``pip install
'vllm-kvcodec[router]'``; ``make install`` includes it). Started in its own
session on a free loopback port once its workers answer, stopped by its pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from storage.testing.ports import reserved_port

MISSING = "vllm-router is not installed: pip install 'vllm-kvcodec[router]' (make install includes it)"


def find_router() -> str | None:
    """The ``vllm-router`` executable: beside this Python (a venv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("vllm-router")


@dataclasses.dataclass
class Router:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_router(worker_urls: Sequence[str], policy: str, log_path: Path, extra: Sequence[str] = (),
                   start_timeout: float = 120.0) -> Iterator[Router]:
    """``vllm-router --worker-urls ... --policy P [extra]`` until /readiness answers; stopped on exit."""
    exe = find_router()
    if exe is None:
        raise RuntimeError(MISSING)
    port, metrics_port = reserved_port(), reserved_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--worker-urls", *worker_urls, "--policy", policy, *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, port, metrics_port, log_path)
    try:
        _wait_ready(router, start_timeout)
        yield router
    finally:
        _stop(router)


def _wait_ready(router: Router, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {router.proc.returncode}:\n{router.log()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(router.url + "/readiness", timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"vllm-router did not become ready within {timeout:.0f} s:\n{router.log()[-3000:]}")


def _stop(router: Router) -> None:
    if router.proc.poll() is None:
        router.proc.send_signal(signal.SIGTERM)
        try:
            router.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(router.proc.pid, signal.SIGKILL)
            router.proc.wait(10)
