"""mkdocs hook: draw the benchmark charts as SVG from the recorded JSON, at build time.

The JSON in ``docs/data/`` is what ``python -m vllm_kvcodec.tools.bench codecs``,
``... ttft`` and ``... quality`` wrote on the development machine (the figures the tables in
``benchmarks.md`` quote). Images are never committed: each build renders
them again into the site as ``plots/<name>.svg``, registered as mkdocs files
so that ``--strict`` link checking sees them. Re-record a benchmark by copying
its new JSON over the old one; the tables in ``benchmarks.md`` are by hand.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

from vllm_kvcodec.tools.bench import plots

# site path of the chart -> (recorded JSON under docs/, the function that draws it)
CHARTS: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "plots/codecs.svg": ("data/codecs.json", plots.codecs_figure),
    "plots/ttft.svg": ("data/ttft.json", plots.ttft_figure),
    "plots/ttft_stages.svg": ("data/ttft.json", plots.ttft_stages_figure),
    "plots/trace_replay.svg": ("data/trace_replay.json", plots.trace_replay_figure),
    "plots/trace_curves.svg": ("data/trace_curves.json", plots.trace_curves_figure),
    "plots/trace_ttft.svg": ("data/trace_curves.json", plots.trace_ttft_figure),
    "plots/quality.svg": ("data/quality.json", plots.quality_figure),
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    docs = Path(config.docs_dir)
    for site_path, (data, draw) in CHARTS.items():
        result = json.loads((docs / data).read_text())
        files.append(File.generated(config, site_path, content=render_svg(draw(result))))
    return files


def render_svg(fig: Any) -> str:
    """SVG text that is the same for the same data (no date, fixed element ids)."""
    with matplotlib.rc_context({"svg.hashsalt": "vllm-kvcodec", "svg.fonttype": "none"}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()
