"""The commands users run first: `make demo`'s `kvcodec demo` and the codec benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def kvcodec(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_kvcodec.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.engine
def test_demo_loads_the_prefix_and_matches_tokens() -> None:
    done = kvcodec("demo", "--tokens", "512")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS" in done.stdout and "tokens loaded from the store" in done.stdout


def test_bench_codecs_writes_json(tmp_path) -> None:
    out = tmp_path / "codecs.json"
    done = kvcodec("bench", "codecs", "--tokens", "512", "--repeats", "1", "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    by_name = {r["name"]: r for r in result["results"]}
    assert all(r["bit_exact"] for r in result["results"])
    assert by_name["rans"]["ratio"] > by_name["splitzip"]["ratio"] > 1.3


def test_unknown_command_fails_cleanly() -> None:
    done = kvcodec("frobnicate")
    assert done.returncode != 0 and "No such command" in (done.stderr + done.stdout)
