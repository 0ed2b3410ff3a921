"""A real ``vllm serve`` (multiprocess engine, SmolLM2 on the CPU) in a subprocess, for the operations tests.

Started in its own session and stopped by pid: SIGTERM to its leader (as an
operator or a supervisor would), then SIGKILL to whatever is left of its
group. Its output goes to a file the test reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "m"
#: Small and quiet, as in tests/support/engine.py, with vLLM's own logging left at its default (INFO).
ENGINE_ARGS = ("--dtype", "bfloat16", "--block-size", "128", "--enforce-eager", "--max-model-len", "2048",
               "--max-num-seqs", "2", "--enable-prefix-caching", "--served-model-name", SERVED_NAME)


def server_env(**extra: str) -> dict[str, str]:
    """The test process's environment for a server: this checkout first on the path, vLLM's default logging."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env.update({"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(ROOT)})
    env.pop("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", None)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, token_ids: list[int], max_tokens: int = 1) -> dict:
        """One greedy /v1/completions request on token ids (the prefix is known to the token)."""
        body = json.dumps({"model": SERVED_NAME, "prompt": token_ids, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """The /metrics scrape: ``(sample name, labels) -> value``."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def terminate(self, timeout: float = 90.0) -> float:
        """SIGTERM to the server, as a supervisor stops it; seconds until it exited."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        return time.monotonic() - t0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@contextlib.contextmanager
def running(argv: Sequence[str], log_path: Path, env: dict[str, str], start_timeout: float = 300.0) -> Iterator[Server]:
    """``python <argv> --host 127.0.0.1 --port P``, once /health answers; killed (group) on exit."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, port, log_path)
    try:
        _wait_healthy(server, start_timeout)
        yield server
    finally:
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.terminate(30)
        server.kill()


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(1)
    raise RuntimeError(f"server did not answer /health within {timeout:.0f} s:\n{server.log()[-4000:]}")


def entry_points_dir(tmp: Path) -> Path:
    """A folder holding a distribution whose only content is pyproject.toml's ``vllm.general_plugins`` entry points.

    Put first on PYTHONPATH, it lets a server find the plug-in as an installed
    package would (through ``importlib.metadata``), from this checkout's
    declaration, without reinstalling the package into the environment.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    group = project["entry-points"]["vllm.general_plugins"]
    dist = tmp / "vllm_kvcodec_entry_points_under_test-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-kvcodec-entry-points-under-test\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in group.items()))
    return tmp
