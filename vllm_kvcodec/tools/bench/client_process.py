"""vLLM's own load client (``vllm bench serve``) in a process of its own, started ahead of the server it measures.

Why ahead: the client spends 8-10 s of one core importing vLLM before it
sends anything, and a server start-up leaves the other core of a small host
mostly idle (its API server and then its engine process import one after the
other). Started first, the client imports while the server starts and waits
for its arguments on stdin; handed them once the server answers, it runs at
once. What it measures is unchanged: it still checks the endpoint with one
request of its own before the run, as ``vllm bench serve`` always does.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_kvcodec.tools.vllm_cli import ARGV_ON_STDIN


class Client:
    """A ``vllm bench serve`` process waiting for its arguments (``python -m vllm_kvcodec.tools.vllm_cli
    --argv-on-stdin``); its output goes to ``client.log`` in ``work``, its result JSON to ``client.json``."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work = work
        with open(work / "client.log", "wb") as log:  # the process holds its own copy of the descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "vllm_kvcodec.tools.vllm_cli", ARGV_ON_STDIN],
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env)

    def result(self, base_url: str, client: list[str], timeout: float | None = None) -> dict[str, Any]:
        """Run ``client`` against ``base_url``; vLLM's whole result JSON."""
        argv = [*client, "--base-url", base_url, "--save-result", "--result-dir", str(self.work),
                "--result-filename", "client.json"]
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it exited early: its log says why, below
            self.proc.stdin.write((json.dumps(argv) + "\n").encode())
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vllm bench serve did not finish within {timeout:.0f} s "
                               f"(see {self.work / 'client.log'})") from None
        if rc != 0:
            log = (self.work / "client.log").read_text(errors="replace")
            raise RuntimeError(f"vllm bench serve exited with {rc}:\n{log[-3000:]}")
        return json.loads((self.work / "client.json").read_text())

    def close(self) -> None:
        """Stop it if it still runs (never told to, or past its timeout)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()


@contextlib.contextmanager
def started_client(work: Path, env: dict[str, str]) -> Iterator[Client]:
    """A :class:`Client` importing vLLM from now on; stopped on exit if it was never run or is still running."""
    client = Client(work, env)
    try:
        yield client
    finally:
        client.close()
