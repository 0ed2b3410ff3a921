"""examples/vllm_serve_redis.sh end to end: kvcodec serve (vllm serve, multiprocess engine) + Redis + KVCodecConnector."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "vllm_serve_redis.sh"
VENV = Path(sys.prefix)


@pytest.mark.engine
@pytest.mark.redis
def test_vllm_serve_redis_example() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    if shutil.which("curl") is None:
        pytest.skip("curl not on PATH")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"no vllm in {VENV}")
    env = dict(os.environ)
    env.update({
        "VENV": str(VENV),
        "OMP_NUM_THREADS": "2",  # at most 2 OMP threads in vllm serve's engine
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "START_TIMEOUT": "240",
        "PREFIX_TOKENS": "300",  # one stored chunk (its default, 1500: five) is the same path, at a fifth of the prefill
    })
    env.pop("MODEL", None)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"script timed out after 600 s; output tail:\n{out[-4000:]}")
    out = proc.stdout + proc.stderr
    tail = f"exit {proc.returncode} after {time.monotonic() - t0:.0f} s; output tail:\n{out[-6000:]}"
    assert proc.returncode == 0, tail
    for n in (1, 2, 3):
        assert re.search(rf"^request {n} .*TTFT \d+ ms", proc.stdout, re.M), tail
    hits = re.search(r"Redis reads that found a key during request 3: (\d+)", proc.stdout)
    assert hits and int(hits.group(1)) >= 1, tail  # the fresh instance read the stored prefix
    m = re.search(r"\bchunks\W+(\d+)", proc.stdout)
    assert m and int(m.group(1)) >= 1, tail
    assert "OK:" in proc.stdout, tail
