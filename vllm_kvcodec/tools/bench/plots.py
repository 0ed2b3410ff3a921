"""Charts of benchmark results, drawn from the JSON the benchmarks write.

One function per benchmark, each taking that benchmark's result dict (what
``run()`` returns and what lands in ``bench-results/*.json``) and returning a
matplotlib ``Figure``. The docs build renders them to SVG from the recorded
JSON in ``docs/data/`` (``mkdocs_hooks/benchmark_plots.py``) and the example
notebooks show the same charts for the runs they make, so a chart in the docs
and one from your own run are directly comparable.

Figures are built with ``matplotlib.figure.Figure``, not pyplot: no GUI
backend and no global state, so the docs build can call them from any thread.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

# One colour per codec everywhere, so charts side by side read alike.
CODEC_COLOURS = {
    "raw": "#7f7f7f",
    "zstd": "#1f77b4",
    "splitzip": "#2ca02c",
    "rans": "#d62728",
    "video": "#9467bd",
    "auto": "#ff7f0e",
}


def codec_colour(name: str) -> str:
    """The colour of a codec name such as ``zstd(level=3)`` or ``auto``."""
    return CODEC_COLOURS.get(name.split("(")[0].split("→")[0], "#8c564b")


def codecs_figure(result: dict[str, Any]) -> Figure:
    """``bench codecs``: compression ratio, and encode/decode speed on a log scale."""
    rows = result["results"]
    names = [_short(r["name"]) for r in rows]
    colours = [codec_colour(r["name"]) for r in rows]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ratio_ax, speed_ax = fig.subplots(1, 2, width_ratios=[1, 1.4])

    ratios = [r["ratio"] for r in rows]
    ratio_ax.barh(names, ratios, color=colours)
    ratio_ax.invert_yaxis()
    ratio_ax.set_xlim(1.0, max(ratios) * 1.08)
    ratio_ax.set_xlabel("compression ratio (raw / stored)")
    for y, v in enumerate(ratios):
        ratio_ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)

    ys = range(len(rows))
    height = 0.4
    speed_ax.barh([y - height / 2 for y in ys], [r["encode_MBps"] for r in rows], height, color=colours, alpha=0.55, label="encode")
    speed_ax.barh([y + height / 2 for y in ys], [r["decode_MBps"] for r in rows], height, color=colours, label="decode")
    speed_ax.set_yticks(list(ys), names)
    speed_ax.invert_yaxis()
    speed_ax.set_xscale("log")
    speed_ax.set_xlabel("MB/s of raw KV, one thread (pale: encode, dark: decode)")
    chunks = result.get("tokens", 0) // max(result.get("chunk_tokens", 1), 1)
    fig.suptitle(f"Codecs on real SmolLM2-135M KV: {chunks} chunks of {result.get('chunk_tokens')} tokens, bit-exact")
    return fig


def ttft_figure(result: dict[str, Any]) -> Figure:
    """``bench ttft``: TTFT of a stored prefix against link bandwidth, per codec, with both baselines."""
    rows = result["results"]
    base = result["baseline"]
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    ax = fig.subplots()
    for codec in dict.fromkeys(r["codec"] for r in rows):
        mine = sorted((r for r in rows if r["codec"] == codec), key=lambda r: r["gbps"])
        ax.plot([r["gbps"] for r in mine], [r["ttft_s"] * 1000 for r in mine], marker="o",
                color=codec_colour(codec), label=_label(mine[0]))
    for seconds, style, text in ((base["recompute_s"], "--", "recompute (no cache)"),
                                 (base["local_hit_s"], ":", "vLLM local prefix-cache hit")):
        ax.axhline(seconds * 1000, color="black", linestyle=style, linewidth=1)
        ax.text(0.01, seconds * 1000, f" {text}: {seconds * 1000:.0f} ms", va="bottom", fontsize=8,
                transform=ax.get_yaxis_transform())
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))  # 2, 3, 5 x 10^k
    ax.set_xlabel(f"link bandwidth, Gbit/s (emulated, RTT {result.get('rtt_ms', 0):g} ms)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"TTFT with a {result['prefix_tokens']}-token prefix from the store "
                 f"+ {result['suffix_tokens']}-token suffix")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def ttft_stages_figure(result: dict[str, Any]) -> Figure:
    """``bench ttft``: the connector's fetch, decode and scatter seconds of one load, per codec and link."""
    rows = result["results"]
    fig = Figure(figsize=(8, 3.8), layout="constrained")
    ax = fig.subplots()
    labels = [f"{r['codec']}\n{r['gbps']:g} Gb/s" for r in rows]
    bottom = [0.0] * len(rows)
    for stage, alpha in (("fetch_s", 1.0), ("decode_s", 0.6), ("scatter_s", 0.3)):
        values = [r[stage] for r in rows]
        ax.bar(labels, values, bottom=bottom, color=[codec_colour(r["codec"]) for r in rows], alpha=alpha,
               edgecolor="black", linewidth=0.3, label=stage.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per load, summed over fetch threads")
    ax.set_title("Where a load spends its time (dark: fetch incl. link wait, mid: decode, pale: scatter)")
    ax.tick_params(axis="x", labelsize=7)
    return fig


def _short(name: str) -> str:
    """``video(backend=hevc,layout=1)`` -> ``video hevc``; ``zstd(level=1)`` -> ``zstd-1``."""
    if name.startswith("zstd(level="):
        return "zstd-" + name[len("zstd(level=") : -1]
    if name.startswith("video("):
        params = dict(p.split("=", 1) for p in name[len("video(") : -1].split(","))
        return f"video {params.get('backend', '')}".strip()
    return name


def _label(row: dict[str, Any]) -> str:
    """The codec asked for, and what ``auto`` chose when it saved."""
    used = row.get("save", {}).get("codecs", row["codec"])
    return row["codec"] if used == row["codec"] else f"{row['codec']} (chose {used})"
