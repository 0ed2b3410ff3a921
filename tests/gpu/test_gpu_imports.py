"""``vllm_kvcodec.gpu`` is device plumbing: it imports neither the chunk format nor a codec, lazily or not.

``codecs/video.py`` imports ``gpu/nvcodec`` (NVENC), and the chunk format
imports the codecs; a ``gpu`` module that read chunk headers (the NVDEC chunk
decoder did) or imported a codec closed a circle that lazy imports only hid.
What reads the chunk format for the device lives above both
(:mod:`vllm_kvcodec.format.device_chunks`). Checked statically (every import statement
and ``import_module`` string in the package's source, function-level ones
included) and at run time (importing every gpu module loads neither).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "vllm_kvcodec" / "gpu"
FORBIDDEN = ("vllm_kvcodec.format", "vllm_kvcodec.codecs", "vllm_kvcodec.format.device_chunks")


def _imported(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            names += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return names


@pytest.mark.parametrize("path", sorted(GPU.glob("*.py")), ids=lambda p: p.name)
def test_gpu_modules_import_no_chunk_format_and_no_codec(path: Path) -> None:
    bad = [n for n in _imported(ast.parse(path.read_text())) if n.startswith(FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}: move what reads chunks to vllm_kvcodec/format/device_chunks.py"


def test_importing_every_gpu_module_loads_neither() -> None:
    modules = sorted(f"vllm_kvcodec.gpu.{p.stem}" for p in GPU.glob("*.py") if p.stem != "__init__")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + f"print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
