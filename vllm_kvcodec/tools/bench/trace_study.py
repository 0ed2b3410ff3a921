"""``kvcodec bench trace --simulate``: the simulator on a whole trace, once or swept into curves, as tables and JSON.

One run prices one fleet (``run_one``). ``--curves`` sweeps the store's size
for each codec (raw, splitzip, rans, video: a better ratio fits more prefixes
in the same bytes) and both routing policies, for each named model, and
derives what the docs quote: the store size at which rans reaches the hit
share raw needs 1.5x the bytes for, and the link bandwidth below which
loading a prefix loses to recomputing it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_kvcodec.tools.bench.report import console, machine, wide_table, write_json
from vllm_kvcodec.tools.bench.trace_file import TRACE_TOKENS_PER_ID, TraceRequest, pieces, prompt_length
from vllm_kvcodec.tools.bench.trace_model import CostModel, break_even_gbps, measured_codecs, model_spec
from vllm_kvcodec.tools.bench.trace_sim import FleetSpec, simulate

CURVE_CODECS = ("raw", "splitzip", "rans", "video")
CURVE_MODELS = ("llama-70b", "llama-8b")
#: Store sizes of the curves, as fractions of the raw KV of every distinct block of the trace.
CURVE_FRACTIONS = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
#: KV tokens per replica for the curves' models: 90 % of the GPUs' memory less bf16 weights, over KV per token
#: (llama-70b on 8 x 80 GB: 576 - 141 GB; llama-8b on one: 72 - 16 GB).
LOCAL_TOKENS = {"llama-70b": 1_330_000, "llama-8b": 437_000, "smollm2-135m": 3_000_000}


def run_one(requests: list[TraceRequest], fleet: FleetSpec, cost: CostModel, output: Path | None,
            max_output: int | None = None, per_request: bool = False, time_scale: float = 1.0) -> dict[str, Any]:
    result = simulate(requests, fleet, cost, max_output=max_output, per_request=per_request, time_scale=time_scale)
    result["machine"] = machine()
    _print_one(result)
    write_json(result, output)
    return result


def _print_one(r: dict[str, Any]) -> None:
    f, sh, g, t = r["fleet"], r["shares"], r["prefill_gpu_s"], r["ttft_s"]
    wide_table(f"{r['requests']} requests, {r['prompt_tokens']} prompt tokens at {f['tokens_per_id']} per id; "
               f"{f['workers']} workers, {f['policy']}; model {r['cost']['model']['name']}, codec "
               f"{r['cost']['codec']['name']}", ["figure", "value"], [
        ["local / store / computed", f"{sh['local']:.1%} / {sh['store']:.1%} / {sh['computed']:.1%}"],
        ["ceiling (never-forgetting cache)", f"{r['ceiling_share']:.1%}"],
        ["prefill GPU-s: without cache, with, saved", f"{g['without_cache']:.0f}, {g['with']:.0f}, {g['saved']:.0f}"],
        ["TTFT p50 / p90 / p99 (modelled)", f"{t['p50']:.3f} / {t['p90']:.3f} / {t['p99']:.3f} s"],
        ["store: objects, bytes held, evictions", f"{r['store']['objects']}, {r['store']['bytes'] / 1e9:.1f} GB, "
                                                  f"{r['store']['evictions']}"],
        ["far bytes read", f"{r['store']['far_bytes_read'] / 1e9:.1f} GB"],
        ["simulated in", f"{r['seconds']:.1f} s"]])


def unique_raw_bytes(requests: list[TraceRequest], kv_bytes_per_token: int) -> int:
    """Raw KV of every distinct piece of the trace: what a store holding everything once would need."""
    seen: dict[int, int] = {}
    for r in requests:
        key = 0
        for h, size in pieces(r, TRACE_TOKENS_PER_ID):
            key = hash((key, h))
            seen[key] = max(seen.get(key, 0), size)
    return sum(seen.values()) * kv_bytes_per_token


def curves(requests: list[TraceRequest], output: Path | None, workers: int = 16, block_tokens: int = 256,
           chunk_tokens: int = 256, models: tuple[str, ...] = CURVE_MODELS, codecs: tuple[str, ...] = CURVE_CODECS,
           policies: tuple[str, ...] = ("round_robin", "longest_prefix"),
           fractions: tuple[float, ...] = CURVE_FRACTIONS, link_gbps: float = 100.0) -> dict[str, Any]:
    """Shares and GPU-seconds saved against the store's size, per model, codec and routing policy."""
    started = time.perf_counter()
    table = measured_codecs()
    out: dict[str, Any] = {"benchmark": "trace-curves", "machine": machine(), "requests": len(requests),
                           "prompt_tokens": sum(prompt_length(r, TRACE_TOKENS_PER_ID) for r in requests),
                           "workers": workers, "block_tokens": block_tokens, "chunk_tokens": chunk_tokens,
                           "link_gbps": link_gbps, "models": {}}
    for name in models:
        model = model_spec(name)
        unique = unique_raw_bytes(requests, model.kv_bytes_per_token)
        entry: dict[str, Any] = {"model": dataclasses.asdict(model), "local_tokens": LOCAL_TOKENS[name],
                                 "unique_raw_bytes": unique, "store_bytes": [int(unique * f) for f in fractions],
                                 "curves": {}, "no_store": {}, "break_even_gbps": {}}
        for policy in policies:
            fleet = FleetSpec(workers=workers, block_tokens=block_tokens, chunk_tokens=chunk_tokens,
                              local_tokens=LOCAL_TOKENS[name], connector=False, policy=policy)
            base = simulate(requests, fleet, CostModel(model, table["raw"], link_gbps=link_gbps))
            entry["no_store"][policy] = _point(base, 0)
            for codec in codecs:
                cost = CostModel(model, table[codec], link_gbps=link_gbps)
                points = []
                for b in entry["store_bytes"]:
                    r = simulate(requests, dataclasses.replace(fleet, connector=True, store_bytes=b), cost)
                    points.append(_point(r, b))
                    console.log(f"{name} {policy} {codec} {b / 1e12:.2f} TB: store {r['shares']['store']:.1%}, "
                                f"computed {r['shares']['computed']:.1%} ({r['seconds']:.0f} s)")
                entry["curves"].setdefault(policy, {})[codec] = points
        for codec in codecs:
            entry["break_even_gbps"][codec] = {str(ctx): break_even_gbps(CostModel(model, table[codec]), ctx)
                                               for ctx in (2048, 8192, 32768)}
        entry["rans_vs_raw"] = {policy: rans_vs_raw(entry["curves"][policy], 1 - entry["no_store"][policy]["computed"])
                                for policy in policies}
        out["models"][name] = entry
    out["seconds"] = time.perf_counter() - started
    _print_curves(out)
    write_json(out, output)
    return out


def _point(r: dict[str, Any], store_bytes: int) -> dict[str, Any]:
    return {"store_bytes": store_bytes, **r["shares"], "gpu_s_saved": r["prefill_gpu_s"]["saved"],
            "gpu_s_without": r["prefill_gpu_s"]["without_cache"], "ttft_s": r["ttft_s"],
            "ttft_histogram": r["ttft_histogram"], "far_bytes_read": r["store"]["far_bytes_read"]}


def rans_vs_raw(curves_of_policy: dict[str, list[dict[str, Any]]], floor: float = 0.0) -> list[dict[str, float]]:
    """Where both curves climb: for each hit share raw reaches at a sampled size (at least a point above
    ``floor``, the share without a store), the bytes rans needs for it (interpolated on a log scale between
    rans's samples) and the ratio: what rans's compression buys in room."""
    raw, rans = curves_of_policy.get("raw"), curves_of_policy.get("rans")
    if not raw or not rans:
        return []
    hits = [p["local"] + p["store"] for p in rans]
    xs, ys = [], []  # rans's strictly climbing part: the smallest store that reaches each hit share
    for p, h in zip(rans, hits):
        if not ys or h > ys[-1] + 1e-12:
            xs.append(np.log(p["store_bytes"]))
            ys.append(h)
    out = []
    top = max(hits)
    for p in raw:
        target = p["local"] + p["store"]
        if len(ys) < 2 or target < floor + 0.01 or not ys[0] < target < min(top, ys[-1]):
            continue  # below every rans sample, or on the plateau where the store holds the whole trace
        needed = float(np.exp(np.interp(target, ys, xs)))
        out.append({"hit_share": target, "raw_bytes": p["store_bytes"], "rans_bytes": needed,
                    "ratio": p["store_bytes"] / needed})
    return out


def _print_curves(out: dict[str, Any]) -> None:
    for name, e in out["models"].items():
        for policy, by_codec in e["curves"].items():
            rows = []
            for i, b in enumerate(e["store_bytes"]):
                rows.append([f"{b / 1e12:.2f}"] + [f"{by_codec[c][i]['local'] + by_codec[c][i]['store']:.1%}"
                                                   for c in by_codec])
            wide_table(f"{name}, {policy}: hit share (local + store) against store TB (no store: "
                       f"{1 - e['no_store'][policy]['computed']:.1%})", ["store TB", *by_codec], rows)
        for policy, rows in e["rans_vs_raw"].items():
            for row in rows:
                console.print(f"{name}, {policy}: hit {row['hit_share']:.1%} takes {row['raw_bytes'] / 1e12:.2f} TB "
                              f"raw, {row['rans_bytes'] / 1e12:.2f} TB rans ({row['ratio']:.2f}x)")
        console.print(f"{name}: loading loses to recomputing below (Gbit/s, 8192-token prefix): " + ", ".join(
            f"{c} {v['8192']:.1f}" for c, v in e["break_even_gbps"].items()))
    console.print(f"[dim]{out['seconds']:.0f} s[/dim]")
