"""The house rules of issue #52, held by reading the source: rooms in layers, no circle, a small package root.

``kvcodec layout`` prints the same figures (tools/layout.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvcodec.tools.layout import circles, read_layout

ROOT = Path(__file__).resolve().parents[2]
#: What may stay at the package root: the plug-in entry point pyproject names, the errors and counters every room uses.
ROOT_MODULES = ["errors", "stats", "vllm_plugin"]
#: No file of the connector (vLLM's calls, planning, metadata) grows past this: past it, it holds two concerns.
CONNECTOR_MAX_LINES = 500


@pytest.fixture(scope="module")
def layout():
    return read_layout(ROOT)


def test_no_import_circle_between_modules_or_rooms_not_even_a_lazy_one(layout) -> None:
    assert layout.module_circles() == []
    assert layout.room_circles() == []


def test_every_room_stands_in_a_layer(layout) -> None:
    placed = {room for level in layout.layers() for room in level}
    assert placed == set(layout.room_imports()), "rooms in a circle have no layer"
    assert layout.layers()[0] == ["errors", "stats", "storage"]  # the bottom: nothing of the package below them
    assert layout.layers()[-1] == ["tools"]  # the top: never imported by the product


def test_the_package_root_holds_only_what_must_be_there(layout) -> None:
    assert layout.root_modules() == ROOT_MODULES


def test_no_connector_file_over_the_limit(layout) -> None:
    over = [(path, n) for path, n in layout.largest(100, "vllm_kvcodec/connector/") if n > CONNECTOR_MAX_LINES]
    assert over == []


def test_the_circle_finder_finds_lazy_and_long_circles() -> None:
    """What the rules above rest on: a circle through several modules, one through a single edge back, none."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_counts(tmp_path) -> None:
    """An import inside a function (or under TYPE_CHECKING) is an edge like any other."""
    for package in ("vllm_kvcodec", "storage"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "vllm_kvcodec" / "a.py").write_text("from vllm_kvcodec import b\n")
    (tmp_path / "vllm_kvcodec" / "b.py").write_text("def f():\n    from vllm_kvcodec.a import x\n")
    assert read_layout(tmp_path).module_circles() == [["vllm_kvcodec.a", "vllm_kvcodec.b"]]


def test_kvcodec_layout_prints_the_figures() -> None:
    done = subprocess.run([sys.executable, "-m", "vllm_kvcodec.tools.cli", "layout", str(ROOT)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "import circles between modules: 0" in done.stdout and "import circles between rooms: 0" in done.stdout
    assert f"modules at the package root: {', '.join(ROOT_MODULES)}" in done.stdout
