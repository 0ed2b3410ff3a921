"""A real ``vllm serve`` (multiprocess engine, SmolLM2 on the CPU) for the operations tests: this checkout's settings.

The process handling (start, /health, scrape, SIGTERM) is the package's
:mod:`vllm_kvcodec.tools.server_process`, which ``kvcodec bench serve`` uses too.
"""

from __future__ import annotations

import functools
import os
import tempfile
import tomllib
from pathlib import Path

from vllm_kvcodec.tools import server_process
from vllm_kvcodec.tools.server_process import SERVED_NAME, Server, free_port  # noqa: F401 - the tests' names

ROOT = Path(__file__).resolve().parents[2]
#: The server runs in this checkout (its package first on the path).
running = functools.partial(server_process.running, cwd=ROOT)
#: Small and quiet, as in tests/support/engine.py, with vLLM's own logging left at its default (INFO).
ENGINE_ARGS = ("--dtype", "bfloat16", "--block-size", "128", "--enforce-eager", "--max-model-len", "2048",
               "--max-num-seqs", "2", "--enable-prefix-caching", "--served-model-name", SERVED_NAME)


SHARED_PROMETHEUS_DIR = tempfile.mkdtemp(prefix="kvcodec-test-prometheus-")


def server_env(**extra: str) -> dict[str, str]:
    """The test process's environment for a server: this checkout first on the path, vLLM's default logging."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env.update({"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(ROOT)})
    env.pop("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", None)
    # as the test process itself has it once vLLM's serve code ran in it: shared by every server that inherits it
    env["PROMETHEUS_MULTIPROC_DIR"] = SHARED_PROMETHEUS_DIR
    env.update(extra)
    return env


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
