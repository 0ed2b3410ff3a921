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


SOURCE_COLOURS = {"local": "#1f77b4", "store": "#d62728", "computed": "#c7c7c7"}


def trace_replay_figure(result: dict[str, Any]) -> Figure:
    """``bench trace``: each configuration's prompt tokens by source (vLLM's counters), and its TTFT."""
    rows = result["configs"]
    labels = [f"({r['config']}) {r['policy']}\n{'connector' if r['connector'] else 'no connector'}"
              + (" + near" if r.get("near_tier") else "") for r in rows]
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    share_ax, ttft_ax = fig.subplots(1, 2, width_ratios=[1.3, 1])
    left = [0.0] * len(rows)
    for source in ("local", "store", "computed"):
        values = [r["shares_vllm"][source] * 100 for r in rows]
        share_ax.barh(labels, values, left=left, color=SOURCE_COLOURS[source], label=source)
        left = [a + b for a, b in zip(left, values)]
    share_ax.axvline(result["ceiling_share"] * 100, color="black", linestyle="--", linewidth=1)
    share_ax.text(result["ceiling_share"] * 100, -0.6, " ceiling", fontsize=8, va="top")
    share_ax.invert_yaxis()
    share_ax.set_xlabel("% of prompt tokens: local cache, loaded from the store, computed")
    share_ax.legend(fontsize=8, loc="lower right")
    y = range(len(rows))
    ttft_ax.barh([i - 0.2 for i in y], [r["median_ttft_ms"] or 0 for r in rows], 0.4, color="#555555", label="p50")
    ttft_ax.barh([i + 0.2 for i in y], [r["p99_ttft_ms"] or 0 for r in rows], 0.4, color="#aaaaaa", label="p99")
    ttft_ax.set_yticks(list(y), [f"({r['config']})" for r in rows])
    ttft_ax.invert_yaxis()
    ttft_ax.set_xlabel("TTFT, ms")
    ttft_ax.legend(fontsize=8)
    sp = result["spec"]
    fig.suptitle(f"{result['requests']} requests of the Mooncake trace at {sp['tokens_per_id']} tokens per id, "
                 f"{sp['workers']} CPU workers behind vllm-router")
    return fig


def trace_curves_figure(result: dict[str, Any]) -> Figure:
    """``bench trace --simulate --curves``: hit share and prefill GPU-hours saved against the store's size."""
    models = list(result["models"])
    fig = Figure(figsize=(10, 3.6 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 2, squeeze=False)
    for (hit_ax, gpu_ax), name in zip(axes, models):
        m = result["models"][name]
        for policy, style in (("round_robin", "-"), ("longest_prefix", ":")):
            for codec, points in m["curves"].get(policy, {}).items():
                tb = [p["store_bytes"] / 1e12 for p in points]
                hit_ax.plot(tb, [(p["local"] + p["store"]) * 100 for p in points], style, marker="o", markersize=3,
                            color=codec_colour(codec), label=f"{codec}, {policy}")
                gpu_ax.plot(tb, [p["gpu_s_saved"] / 3600 for p in points], style, marker="o", markersize=3,
                            color=codec_colour(codec))
            base = m["no_store"].get(policy)
            if base:
                hit_ax.axhline((base["local"] + base["store"]) * 100, color="black", linestyle=style, linewidth=0.8)
        hit_ax.set_xscale("log")
        gpu_ax.set_xscale("log")
        hit_ax.set_xlabel("shared store, TB")
        gpu_ax.set_xlabel("shared store, TB")
        hit_ax.set_ylabel("% of prompt tokens not computed")
        gpu_ax.set_ylabel("prefill GPU-hours saved (of the hour)")
        hit_ax.set_title(f"{name}: hit share (black: local caches only)", fontsize=9)
        gpu_ax.set_title(f"{name}: prefill saved", fontsize=9)
        hit_ax.grid(True, which="both", alpha=0.3)
        gpu_ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"The whole Mooncake hour ({result['requests']} requests) on {result['workers']} replicas, simulated "
                 "(solid: round robin, dotted: longest local prefix)")
    return fig


def trace_ttft_figure(result: dict[str, Any]) -> Figure:
    """``bench trace --simulate --curves``: the modelled TTFT distribution without a store and with each codec's."""
    from vllm_kvcodec.tools.bench.trace_sim import histogram_edges

    models = list(result["models"])
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, name in zip(axes, models):
        m = result["models"][name]
        pick = len(m["store_bytes"]) // 2
        rows = [("no store", "#000000", m["no_store"]["round_robin"])]
        rows += [(codec, codec_colour(codec), pts[pick]) for codec, pts in m["curves"]["round_robin"].items()]
        for label, colour, point in rows:
            h = point["ttft_histogram"]
            edges, counts = histogram_edges(h["top_s"]), h["counts"]
            total = sum(counts) or 1
            cdf, run = [], 0
            for c in counts:
                run += c
                cdf.append(run / total * 100)
            ax.step(edges[1:], cdf, where="post", color=colour, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("modelled TTFT, s")
        ax.set_ylabel("% of requests")
        ax.set_title(f"{name}, round robin, store {m['store_bytes'][pick] / 1e12:.1f} TB", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return fig


PRECISION_COLOURS = {"lossless": "#d62728", "int8": "#1f77b4", "int6": "#2ca02c", "int4": "#9467bd"}


def quality_figure(result: dict[str, Any]) -> Figure:
    """``bench quality``: rate against distortion. ΔNLL per token (95 % interval) and mean KL against the bits each
    value is stored in; grey: bf16 arithmetic alone (the noise floor); orange: the papers' reported ratios, as bands
    (their models; they report no ΔNLL)."""
    fig = Figure(figsize=(10, 5), layout="constrained")
    nll_ax, kl_ax = fig.subplots(1, 2)
    floor = result.get("noise_floor")
    if floor:
        ci = floor["delta_nll_ci95"] or [floor["delta_nll"]] * 2
        nll_ax.axhspan(ci[0], ci[1], color="#7f7f7f", alpha=0.2, label=f"{floor['name']}: 95 % interval")
        kl_ax.axhline(floor["kl_mean"], color="#7f7f7f", linestyle="--")
        kl_ax.text(0.99, floor["kl_mean"], "bf16 arithmetic alone ", transform=kl_ax.get_yaxis_transform(), ha="right",
                   va="bottom", fontsize=7, color="#555555")
    for r in (result["control"], *result["results"]):
        kept = r["precision"]["sink_tokens"] or r["precision"]["full_layers"]
        style = {"fmt": "s" if kept else "o", "color": PRECISION_COLOURS.get(r["precision"]["name"], "#8c564b"),
                 "mfc": "white" if kept else None}
        label = f"{r['name']}: {r['ratio']:.2f}x" + (", bit-exact (control)" if r["bit_exact"] else "")
        ci = r["delta_nll_ci95"] or [r["delta_nll"]] * 2
        nll_ax.errorbar(r["bits_per_value"], r["delta_nll"], yerr=[[r["delta_nll"] - ci[0]], [ci[1] - r["delta_nll"]]],
                        capsize=3, label=label, **style)
        if not r["bit_exact"]:  # the control's KL is 0: no place on a log axis
            kl_ax.errorbar(r["bits_per_value"], r["kl_mean"], **style)
    nll_ax.axhline(0, color="black", linewidth=0.6)
    nll_ax.axhline(0.01, color="#1f77b4", linestyle=":", linewidth=1)
    nll_ax.text(0.99, 0.01, "int8's target: ΔNLL <= 0.01 ", transform=nll_ax.get_yaxis_transform(), ha="right",
                va="bottom", fontsize=7, color="#1f77b4")
    for ax in (nll_ax, kl_ax):
        _reported_bands(ax, result.get("reported", []))
        ax.axvline(16, color="#7f7f7f", linestyle=":", linewidth=1)
        ax.text(16, 0.98, "raw bf16 ", transform=ax.get_xaxis_transform(), ha="right", va="top", fontsize=7)
        ax.set_xlim(0, 17)
        ax.set_xlabel("stored bits per value (16 / ratio, all included)")
        ax.grid(True, alpha=0.3)
    kl_ax.set_yscale("log")
    nll_ax.set_ylabel("ΔNLL, nats per token (95 % interval)")
    kl_ax.set_ylabel("mean KL(computed KV || stored KV), nats")
    handles, labels = nll_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7)
    fig.suptitle(f"{result['model']}: what each precision level costs (lossy: not bit-exact)\n"
                 "orange: ratios as reported, their models, not ours; they report no ΔNLL", fontsize=10)
    return fig


def _reported_bands(ax: Any, reported: list[dict[str, Any]]) -> None:
    """Each paper's ratio at 16 / ratio bits per value: a band for a range, a dashed line for one figure."""
    for paper in reported:
        low, high = (16 / x for x in sorted(paper["ratio"], reverse=True))
        if high - low > 1e-9:
            ax.axvspan(low, high, color="#ff7f0e", alpha=0.15)
        else:
            ax.axvline(low, color="#ff7f0e", linestyle="--", linewidth=1)
        ratio = "-".join(f"{x:g}" for x in dict.fromkeys(paper["ratio"]))
        ax.text(high + 0.05, 0.03, f" {paper['name']} {ratio}x, as reported", transform=ax.get_xaxis_transform(),
                rotation=90, ha="left", va="bottom", fontsize=7, color="#a04000")


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
