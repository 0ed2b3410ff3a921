"""A real ``vllm serve`` in a subprocess: started, waited for, scraped and stopped as a supervisor would.

Started in its own session and stopped by pid: SIGTERM to its leader (as an
operator or a supervisor would), then SIGKILL to whatever is left of its
group. Its output goes to a file. Used by ``kvcodec bench serve`` and by the
operations tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from storage.testing.ports import reserved_port as free_port  # noqa: F401 - the name the tests import

SERVED_NAME = "m"


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
def running(argv: Sequence[str], log_path: Path, env: dict[str, str], start_timeout: float = 300.0,
            cwd: Path | None = None) -> Iterator[Server]:
    """``python <argv> --host 127.0.0.1 --port P``, once /health answers; killed (group) on exit.

    Started again on another port (twice at most) when some other process
    turns out to hold the one picked.
    """
    for attempt in range(3):
        server = _start(argv, log_path, env, cwd)
        try:
            _wait_healthy(server, start_timeout)
            break
        except PortTakenError:
            stop(server)
            if attempt == 2:
                raise
        except BaseException:
            stop(server)
            raise
    try:
        yield server
    finally:
        stop(server)


class PortTakenError(RuntimeError):
    pass


def _start(argv: Sequence[str], log_path: Path, env: dict[str, str], cwd: Path | None) -> Server:
    # A PROMETHEUS_MULTIPROC_DIR inherited from the caller (vLLM sets one in any process that ran its serve
    # code) is shared by every server started with it, and by in-process engines: each /metrics then sums
    # them all (a test's server reported 57 completions for its 2; CI, 39). Unset, each server makes its own.
    env = {k: v for k, v in env.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port)], cwd=cwd,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(proc, port, log_path)


def stop(server: Server) -> None:
    """SIGTERM, 30 s to exit, then SIGKILL to its whole process group."""
    if server.proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.terminate(30)
    server.kill()


def _wait_healthy(server: Server, timeout: float) -> None:
    wait_answering(server, timeout)


def wait_answering(server: Server, timeout: float, path: str = "/health", name: str = "server",
                   owned: bool = True) -> None:
    """Until ``path`` answers 200 (from this server's own process tree, with ``owned``); an error with the log's
    end if the process exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(server.url + path, timeout=5) as resp:
                if resp.status == 200 and (not owned or _listens(server.proc.pid, server.port)):
                    return
        time.sleep(0.25)  # a refused connection costs nothing; each second slept is one more per server start
    raise RuntimeError(f"{name} did not answer {path} within {timeout:.0f} s:\n{server.log()[-4000:]}")


def _listens(pid: int, port: int) -> bool:
    """Whether ``port`` is held by this server's own process tree, not by some other process that answers /health.

    Raises when another process listens there: our server cannot bind it,
    and what answers would be someone else's engine.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="tcp")):
                return True
    raise PortTakenError(f"port {port} is answered by a process outside this server's tree (pid {pid})")
