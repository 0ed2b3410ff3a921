"""Another ``storage`` package shadowing vllm-kvcodec's is refused when vllm_kvcodec is imported, by path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def import_in(cwd: Path, module: str) -> subprocess.CompletedProcess:
    """``import module`` in a fresh interpreter run in ``cwd`` (first on its sys.path, as for any ``python -c``)."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))


@pytest.mark.parametrize("module", ["vllm_kvcodec", "vllm_kvcodec.format", "vllm_kvcodec.connector.config"])
def test_a_shadowing_storage_package_is_refused_by_path(tmp_path, module: str) -> None:
    other = tmp_path / "storage"
    other.mkdir()
    (other / "__init__.py").write_text('"""Some other project\'s storage layer."""\n')
    done = import_in(tmp_path, module)  # a project folder that has a 'storage' package of its own
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: vllm_kvcodec: 'import storage' found a package that is not vllm-kvcodec's")
    assert str(other) in last


def test_vllm_kvcodecs_own_storage_is_accepted() -> None:
    done = import_in(Path.cwd(), "vllm_kvcodec.format")
    assert done.returncode == 0, done.stderr
