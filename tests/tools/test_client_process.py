"""vLLM's bench client started ahead of its server: it waits for its arguments, runs nothing without them, and a
run that fails says why (the runs against real servers are in test_bench_serve.py and test_bench_trace.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_kvcodec.tools.bench.client_process import started_client
from vllm_kvcodec.tools.vllm_cli import ARGV_ON_STDIN


def test_a_waiting_client_runs_what_it_is_told_and_nothing_when_told_nothing(tmp_path) -> None:
    told_nothing = subprocess.Popen([sys.executable, "-m", "vllm_kvcodec.tools.vllm_cli", ARGV_ON_STDIN],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with started_client(tmp_path, dict(os.environ)) as client:
        with pytest.raises(RuntimeError, match=r"exited with 2:[\s\S]*unrecognized arguments: --no-such-option"):
            client.result("http://127.0.0.1:9", ["bench", "serve", "--no-such-option"], timeout=300)
    out, _ = told_nothing.communicate(b"", timeout=300)  # stdin closed with no arguments
    assert told_nothing.returncode == 0 and b"usage" not in out and b"Error" not in out, out[-2000:]
