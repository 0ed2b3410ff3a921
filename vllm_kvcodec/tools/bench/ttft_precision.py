"""``bench ttft --precision``: TTFT where the papers operate, per precision level (LOSSY: NOT BIT-EXACT rows).

The rows are raw reuse (codec ``raw``) and lossless (``rans``) beside each
lossy level (``precision: int8 | int6 | int4``, the ``quantized`` codec),
all loaded by the same machinery as every other ``bench ttft`` row.

**Scaled links.** Whether a smaller object pays depends on how long its raw
transfer takes against the prefill it replaces. The paper's links (KVCodec:
1-40 Gbit/s) are scaled so that this ratio is the same here as there:
``B_host = B_paper * (host tok/s * host KV B/token) / (paper tok/s * paper KV
B/token)``. The host's prefill speed is the fastest recompute baseline's (on a
shared machine the slower ones measure other processes too); the paper's
is estimated from FLOPs (its text gives none that we have), and
``--paper-prefill-tok-s`` overrides the estimate.

**Crossover.** Each level against raw reuse and against lossless: the
measured links at which it is faster, and a model fitted per row set,
``TTFT(B) = t_other + t_decode + 8 * bytes / B`` (``t_decode``: the
connector's decode and scatter seconds; ``bytes``: what one load read;
``t_other``: the median residual over the links), whose crossing gives the
bandwidth below which the level pays. Every TTFT here is the fastest of a
row's requests (and recompute the fastest baseline): on a shared 2-core host
other processes stall an engine for seconds at a time (one engine's local
hits read 62 ms and 5.7 s minutes apart), which only ever adds time, and a
stall in either half of an in-engine pair (``over_local``) corrupts its ratio.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path
from typing import Any

from vllm_kvcodec.codecs.precision import LOSSLESS, LOSSY_LABEL, parse_precision
from vllm_kvcodec.tools.bench.report import console, wide_table

#: The links KVCodec measures over (Gbit/s).
PAPER_GBPS = (1.0, 4.0, 16.0, 40.0)
#: The row lossless stands for twice: raw reuse, and the best lossless codec.
LOSSLESS_CODECS = ("raw", "rans")
#: The paper's setting, for the prefill estimate: Yi-34B (60 layers, 8 KV heads of 128, bf16) on an NVIDIA H20.
PAPER = {
    "source": "KVCodec (arXiv 2602.09725)",
    "model": "Yi-34B",
    "gpu": "NVIDIA H20",
    "kv_bytes_per_token": 60 * 8 * 128 * 2 * 2,
    "flop_per_token": 2 * 34.4e9,
    "gpu_flop_s": 148e12,  # H20, bf16 dense
    "mfu": 0.5,  # assumed: prefill is compute-bound; 50% is a typical long-prompt MFU
}
#: KVCodec's TTFT over raw KV reuse at 16 Gbit/s, as reported (their GPU and model, not measured here).
KVCODEC_OVER_RAW_AT_16 = 3.51


def parse_levels(specs: list[str]) -> list[str]:
    """``lossless,int8`` or repeated options -> the precisions asked for, each once, in order."""
    names = [parse_precision(s.strip()).name for spec in specs for s in spec.split(",") if s.strip()]
    return list(dict.fromkeys(names))


def plans(codecs: list[tuple[str, Any]], levels: list[str]) -> list[tuple[str, Any, dict[str, Any]]]:
    """(row name, codec, extra connector config) per row: the (named) lossless codecs, then each lossy level (its
    objects are ``quantized`` whatever the codec; ``rans`` stores any chunk it cannot quantise)."""
    rows = [(name, codec, {}) for name, codec in codecs]
    return rows + [(level, "rans", {"precision": level}) for level in levels if level != LOSSLESS]


def label(name: str, precision: str) -> str:
    return name if precision == LOSSLESS else f"{name} ({LOSSY_LABEL})"


def reads(loads: list[dict[str, float]]) -> dict[str, int]:
    """Objects read per precision over the timed loads (the fetcher's ``precision_reads_*`` counters)."""
    out: collections.Counter[str] = collections.Counter()
    for d in loads:
        out.update({k.removeprefix("precision_reads_"): int(v) for k, v in d.items() if k.startswith("precision_reads_") and v})
    return dict(out)


def paper_prefill_tok_s(paper: dict[str, Any] = PAPER) -> float:
    """The paper's prefill tokens per second, estimated: the GPU's FLOP/s at the assumed MFU over FLOP per token."""
    return paper["gpu_flop_s"] * paper["mfu"] / paper["flop_per_token"]


def host_kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 K and V per token of the model in ``model`` (its config.json)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 2


def scaling(host_tok_s: float, host_kv_bytes: int, paper_tok_s: float | None, paper_gbps: list[float]) -> dict[str, Any]:
    """The host links that stand for ``paper_gbps``: raw-KV transfer time over prefill time kept equal."""
    estimated = paper_tok_s is None
    paper_tok_s = paper_prefill_tok_s() if estimated else paper_tok_s
    factor = host_tok_s * host_kv_bytes / (paper_tok_s * PAPER["kv_bytes_per_token"])
    links = {g: float(f"{g * factor:.3g}") for g in paper_gbps}
    return {
        "formula": "B_host = B_paper * (host_prefill_tok_s * host_kv_B_per_tok) / (paper_prefill_tok_s * paper_kv_B_per_tok)",
        "host_prefill_tok_s": host_tok_s,  # the prompt's tokens over the fastest recompute
        "host_kv_bytes_per_token": host_kv_bytes,
        "paper": PAPER,
        "paper_prefill_tok_s": paper_tok_s,
        "paper_prefill_tok_s_source": "estimated: gpu_flop_s * mfu / flop_per_token" if estimated else "given (--paper-prefill-tok-s)",
        "factor": factor,
        "links": [{"paper_gbps": g, "host_gbps": h} for g, h in links.items()],
    }


def fastest(row: dict[str, Any]) -> float:
    """The row's least disturbed TTFT: other processes only add time."""
    return min(row["ttft_all_s"])


def fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``TTFT(B) = t_other + t_decode + 8 * bytes / B`` for one row set (one codec or level over the links)."""
    nbytes = statistics.median(r["loaded_bytes"] for r in rows)
    t_decode = statistics.median(r["decode_s"] + r["scatter_s"] for r in rows)
    wire = {r["gbps"]: 8 * nbytes / (r["gbps"] * 1e9) for r in rows}
    t_other = statistics.median(fastest(r) - wire[r["gbps"]] - t_decode for r in rows)
    model = {r["gbps"]: t_other + t_decode + wire[r["gbps"]] for r in rows}
    return {"bytes": nbytes, "t_decode_s": t_decode, "t_other_s": t_other, "t_fixed_s": t_other + t_decode,
            "max_abs_residual_s": max(abs(fastest(r) - model[r["gbps"]]) for r in rows)}


def crossing(level: dict[str, Any], ref: dict[str, Any]) -> float | None:
    """The bandwidth (Gbit/s) below which ``level``'s modelled TTFT is below ``ref``'s: inf where it is at every
    bandwidth, None where at none."""
    fewer_bits = 8 * (ref["bytes"] - level["bytes"])
    slower_fixed = level["t_fixed_s"] - ref["t_fixed_s"]
    if fewer_bits <= 0:
        return math.inf if slower_fixed < 0 else None
    return math.inf if slower_fixed <= 0 else fewer_bits / slower_fixed / 1e9


def measured(level: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured links at which ``level`` is faster than ``ref``, and the highest below which it always is."""
    ref_by = {r["gbps"]: fastest(r) for r in ref}
    links = sorted(r["gbps"] for r in level if r["gbps"] in ref_by)
    faster = {r["gbps"]: fastest(r) < ref_by[r["gbps"]] for r in level if r["gbps"] in ref_by}
    below = None
    for g in links:
        if not faster[g]:
            break
        below = g
    above = next((g for g in links if not faster[g]), None)
    return {"faster_at_gbps": [g for g in links if faster[g]], "faster_up_to_gbps": below, "slower_from_gbps": above}


def summarize(rows: list[dict[str, Any]], scale: dict[str, Any] | None) -> dict[str, Any]:
    """Each level's fit, crossovers (measured and modelled) against raw and lossless, and speed-up at 16 Gbit/s."""
    sets: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["full_hit"]:
            sets.setdefault(r["codec"], []).append(r)
    fits = {name: fit(rs) for name, rs in sets.items()}
    factor = scale["factor"] if scale else None
    crossover: dict[str, Any] = {}
    for name, rs in sets.items():
        if name in LOSSLESS_CODECS:
            continue
        entry: dict[str, Any] = {"label": label(name, rs[0]["precision"])}
        for ref in LOSSLESS_CODECS:
            if ref not in sets:
                continue
            b = crossing(fits[name], fits[ref])
            finite = b is not None and not math.isinf(b)
            entry[f"vs_{ref}"] = {"measured": measured(rs, sets[ref]),
                                  "modelled": "never" if b is None else "below" if finite else "always",
                                  "modelled_below_gbps": b if finite else None,
                                  "modelled_below_paper_gbps": b / factor if factor and finite else None}
        crossover[name] = entry
    return {"label": LOSSY_LABEL, "ttft": "the fastest of each row's requests",
            "model": "TTFT(B) = t_other + t_decode + 8 * bytes / B, per row set",
            "fits": fits, "crossover": crossover, "speedup_at_paper_16": _at_16(sets, scale)}


def _at_16(sets: dict[str, list[dict[str, Any]]], scale: dict[str, Any] | None) -> dict[str, Any]:
    """Raw reuse's TTFT over each row's at the link that stands for the paper's 16 Gbit/s, beside KVCodec's."""
    host = next((l["host_gbps"] for l in (scale or {}).get("links", []) if l["paper_gbps"] == 16.0), None)
    raw = next((r for r in sets.get("raw", []) if r["gbps"] == host), None)
    out: dict[str, Any] = {"host_gbps": host,
                           "KVCodec, as reported (Yi-34B on their GPUs, not measured here)": KVCODEC_OVER_RAW_AT_16}
    if raw is None:
        return out
    for name, rs in sets.items():
        row = next((r for r in rs if r["gbps"] == host), None)
        if row is not None:
            out[label(name, row["precision"])] = fastest(raw) / fastest(row)
    return out


def print_summary(result: dict[str, Any]) -> None:
    """The TTFT table where the papers operate, then each level's crossovers."""
    p, b = result["precision"], result["baseline"]
    scale = p.get("scaling")
    paper_of = {l["host_gbps"]: l["paper_gbps"] for l in scale["links"]} if scale else {}
    raw = {r["gbps"]: fastest(r) for r in result["results"] if r["codec"] == "raw"}
    if scale:
        console.print(f"scaled links: factor {scale['factor']:.4g} = host {scale['host_prefill_tok_s']:.0f} tok/s x "
                      f"{scale['host_kv_bytes_per_token']} B/token over paper {scale['paper_prefill_tok_s']:.0f} tok/s "
                      f"({scale['paper_prefill_tok_s_source']}) x {PAPER['kv_bytes_per_token']} B/token; "
                      + ", ".join(f"{l['paper_gbps']:g} -> {l['host_gbps']:g}" for l in scale["links"]) + " Gbit/s")
    recompute = min(b["recompute_all_s"])
    wide_table(
        f"TTFT where the papers operate ({LOSSY_LABEL} where a row says so): the fastest of each row's "
        f"{result['repeats']} requests; recompute {recompute * 1000:.0f} ms (the fastest of {len(b['recompute_all_s'])})",
        ["row", "paper Gbit/s", "host Gbit/s", "TTFT ms", "÷raw", "÷recompute", "ratio", "fetch s", "decode s",
         "scatter s", "reads"],
        [[r["label"], f"{paper_of[r['gbps']]:g}" if r["gbps"] in paper_of else "-", f"{r['gbps']:g}",
          f"{fastest(r) * 1000:.0f}", f"{fastest(r) / raw[r['gbps']]:.2f}" if r["gbps"] in raw else "-",
          f"{fastest(r) / recompute:.2f}", f"{r['ratio']:.3f}", f"{r['fetch_s']:.3f}", f"{r['decode_s']:.3f}",
          f"{r['scatter_s']:.3f}", ", ".join(f"{k} {v}" for k, v in sorted(r["precision_reads"].items())) or "-"]
         for r in sorted(result["results"], key=lambda r: (r["gbps"], fastest(r)))],
    )
    wide_table(
        "crossover: the bandwidth below which each level beats raw reuse / lossless rans; measured: the highest "
        "measured link up to which it is faster at every one; modelled: the fit's crossing (host Gbit/s, paper's)",
        ["level", "vs raw measured", "vs raw modelled", "vs rans measured", "vs rans modelled", "t_fixed ms",
         "t_decode ms", "fit max residual ms"],
        [[c["label"], *_crossing_cells(c.get("vs_raw")), *_crossing_cells(c.get("vs_rans")),
          f"{p['fits'][n]['t_fixed_s'] * 1000:.0f}", f"{p['fits'][n]['t_decode_s'] * 1000:.0f}",
          f"{p['fits'][n]['max_abs_residual_s'] * 1000:.0f}"] for n, c in p["crossover"].items()],
    )
    at16 = p["speedup_at_paper_16"]
    if at16.get("host_gbps") is not None:
        console.print(f"TTFT(raw) / TTFT(row) at the paper's 16 Gbit/s ({at16['host_gbps']:g} here): "
                      + "; ".join(f"{k} {v:.2f}x" for k, v in at16.items() if k != "host_gbps"))


def _crossing_cells(c: dict[str, Any] | None) -> list[str]:
    if c is None:
        return ["-", "-"]
    m = c["measured"]
    if m["faster_up_to_gbps"] is None:
        seen = "slower at every link" if not m["faster_at_gbps"] else f"faster at {m['faster_at_gbps']} only"
    else:
        seen = f"<= {m['faster_up_to_gbps']:g}" + (f" (not {m['slower_from_gbps']:g})" if m["slower_from_gbps"] else " (all)")
    b, pb = c["modelled_below_gbps"], c["modelled_below_paper_gbps"]
    model = c["modelled"] if b is None else f"< {b:.3g}" + (f" ({pb:.3g})" if pb is not None else "")
    return [seen, model]
