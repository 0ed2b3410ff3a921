"""The docs site builds with ``mkdocs build --strict`` (no broken links, every page in the nav)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "matplotlib")),
    reason="mkdocs / mkdocs-material / matplotlib not installed (pip install 'vllm-kvcodec[docs]')",
)


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    out = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "index.html").is_file()
    assert (out / "configuration" / "index.html").is_file()
    # The benchmark charts, drawn by the mkdocs hook from docs/data/*.json, are in the site and on the page.
    benchmarks = (out / "benchmarks" / "index.html").read_text()
    for name in ("codecs", "ttft", "ttft_stages"):
        svg = (out / "plots" / f"{name}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg and "<path" in svg
        assert f'src="../plots/{name}.svg"' in benchmarks
    trace = (out / "production-trace" / "index.html").read_text()
    for name in ("trace_replay", "trace_curves", "trace_ttft"):
        svg = (out / "plots" / f"{name}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg and "<path" in svg
        assert f'src="../plots/{name}.svg"' in trace
    svg = (out / "plots" / "quality.svg").read_text()
    assert svg.startswith("<?xml") and "<svg" in svg and "<path" in svg
    assert 'src="../plots/quality.svg"' in (out / "precision" / "index.html").read_text()
    assert '<pre class="mermaid">' in (out / "architecture" / "index.html").read_text()
