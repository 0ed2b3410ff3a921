"""TTFT of a 4k-token shared prefix loaded through the connector, per codec and link speed.

SmolLM2-135M in an in-process vLLM engine on the CPU; the store is the file
store in a temporary directory behind :class:`storage.testing.link.LinkEmulator`
(``link+file://...?gbps=G&rtt_ms=R``) at 1, 10 and 100 Gbit/s. With ``store``
(any store URL, e.g. ``mooncake://...`` or ``redis://...``) that store sits
behind the link instead, each codec under a key prefix of its own; its objects
are left to the store's own eviction.

For every codec the store is populated once (a cold engine computes the
``prefix + suffix0`` prompt and saves its chunks; we wait for the background
saves), then, for every link speed, a fresh engine whose store sits behind that
link serves ``prefix + suffix_k`` with ``max_tokens=1``: the prefix comes from
the store, the suffix is computed. vLLM's local prefix cache is reset before
every timed request (``LLM.reset_prefix_cache()``), so each one really loads.
``auto`` chooses its codec from the link it saves over, so its store is
populated separately for every link speed.

Baselines, from an engine without the connector: ``recompute`` (the whole
prompt is computed) and ``local hit`` (the prefix is in vLLM's own prefix
cache; only the suffix is computed: the floor any load can reach).

TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1`` (vLLM fills
``RequestOutput.metrics`` only with stats logging on), the median of
``repeats`` requests after one untimed warm-up request per engine. Each timed
request is followed by the same prompt once more, which vLLM's local prefix
cache serves in the same engine; the targets read the median of those pairs'
ratios (``over_local``), since on a shared machine an engine's speed drifts
by up to 2x between engines started minutes apart and TTFTs of different
engines cannot be compared, while two requests a few hundred ms apart can. Stage
seconds (fetch, decode, scatter) are the connector's own counters for one
load, summed over its fetch threads (so they can exceed the wall time); fetch
includes the emulated link's wait.

With ``precisions`` the rows are raw reuse and lossless ``rans`` beside each
lossy level (LOSSY: NOT BIT-EXACT), over links scaled to where the papers
operate, with each level's crossover (:mod:`.ttft_precision`).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from storage.options import split_query, with_query

from vllm_kvcodec.codecs.precision import LOSSLESS, LOSSY_LABEL
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.bench import replay as replay_bench
from vllm_kvcodec.tools.bench import ttft_precision
from vllm_kvcodec.tools.bench.cpu_floor import cpu_floor, usable_cores
from vllm_kvcodec.tools.bench.report import console, machine, wide_table, write_json

DEFAULT_CODECS = ("raw", "zstd", "splitzip", "rans", "auto")
QUICK_CODECS = ("raw", "rans", "auto")
DEFAULT_GBPS = (1.0, 10.0, 100.0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _codecs_used(stats: dict[str, float], kind: str) -> str:
    from vllm_kvcodec.tools.demo import codec_names

    return codec_names(stats, kind)


def _name(codec: Any) -> str:
    if isinstance(codec, dict):
        extra = ",".join(f"{k}={v}" for k, v in codec.items() if k != "id")
        return f"{codec['id']}({extra})" if extra else codec["id"]
    return str(codec)


def run(
    output: Path | None = Path("bench-results/ttft.json"),
    codecs: list[Any] | None = None,
    gbps: list[float] | None = None,
    rtt_ms: float = 0.2,
    prefix_tokens: int = 4096,
    suffix_tokens: int = 64,
    repeats: int = 3,
    video: bool = False,
    quick: bool = False,
    chunk_size: int = 256,
    store: str | None = None,
    replay: bool = False,
    replay_only: bool = False,
    replay_repeats: int = 10,
    load_wait: str = "auto",
    precisions: list[str] | None = None,
    paper_scale: bool | None = None,
    paper_gbps: list[float] | None = None,
    paper_prefill_tok_s: float | None = None,
) -> dict[str, Any]:
    """``precisions`` (e.g. ``["lossless,int8"]``): the precision rows; they scale the paper's links
    (``paper_gbps``) to this host unless ``gbps`` is given or ``paper_scale`` is False."""
    levels, paper_scale = precision_settings(precisions, paper_scale, gbps, replay_only)
    fresh_numba = _fresh_numba_cache()
    from vllm_kvcodec.tools.demo import BLOCK_SIZE, Engine, engine_env

    engine_env()
    from vllm_kvcodec.tools.smollm2 import model_dir, sample_token_ids

    started = time.perf_counter()
    if codecs is None and levels:
        codecs = list(ttft_precision.LOSSLESS_CODECS)
    if codecs is None:
        codecs = list(QUICK_CODECS if quick else DEFAULT_CODECS)
        if video:
            codecs.append("video")
    if quick:
        repeats = min(repeats, 2)
    links = list(gbps or DEFAULT_GBPS)
    load_before = os.getloadavg()
    if load_before[0] > 0.7:
        console.print(f"[yellow]warning: load average {load_before[0]:.1f} before the run; other processes on this "
                      f"{os.cpu_count()}-core machine will slow prefill and distort TTFT[/yellow]")

    with console.status("preparing SmolLM2 and the prompts"):
        model_dir()
        n_suffixes = repeats + 3
        ids = sample_token_ids(prefix_tokens + suffix_tokens * n_suffixes)
    prefix = ids[:prefix_tokens]
    suffixes = [ids[prefix_tokens + i * suffix_tokens : prefix_tokens + (i + 1) * suffix_tokens] for i in range(n_suffixes)]
    prompts = [prefix + s for s in suffixes]  # [0]: populate, [1]: warm-up, [2:]: timed
    max_len = -(-(prefix_tokens + suffix_tokens + 2) // BLOCK_SIZE) * BLOCK_SIZE
    expected_hit = (prefix_tokens + suffix_tokens - 1) // chunk_size * chunk_size
    tmp = Path(tempfile.mkdtemp(prefix="kvcodec-ttft-"))
    rows: list[dict[str, Any]] = []
    replay_rows: list[dict[str, Any]] = []
    variants = ttft_precision.plans([(_name(c), c) for c in codecs], levels)
    baseline: dict[str, Any] = {}
    scale: dict[str, Any] | None = None
    try:
        with console.status("") as status:
            if replay_only:  # the ExampleConnector comparison alone: minutes, not the full hour
                replay_rows = replay_bench.run(_replay_codecs(codecs), prompts[0], tmp, max_len, chunk_size, replay_repeats,
                                               load_wait, status)
            else:
                baseline = _baselines(prompts, repeats, max_len, status)
            if paper_scale:
                # the fastest recompute: the host's own speed, least slowed by other processes on the cores
                scale = ttft_precision.scaling((prefix_tokens + suffix_tokens) / min(baseline["recompute_all_s"]),
                                               ttft_precision.host_kv_bytes_per_token(model_dir()), paper_prefill_tok_s,
                                               list(paper_gbps or ttft_precision.PAPER_GBPS))
                links = [link["host_gbps"] for link in scale["links"]]
                console.log("the paper's links here: " + ", ".join(
                    f"{link['paper_gbps']:g} -> {link['host_gbps']:g} Gbit/s" for link in scale["links"]))
            plans = [] if replay_only else [(v, g) for v in variants for g in links]
            # ---- connector loads -----------------------------------------------------------
            populated: dict[str, dict[str, Any]] = {}
            for n, ((name, codec, extra), g) in enumerate(plans, 1):
                where = f"[{n}/{len(plans)}] {name} at {g:g} Gbit/s"
                # auto picks its codec from the link it saves over: one store per link speed
                store_key = f"{name}@{g:g}" if codec == "auto" else name
                url = _plan_url(store, tmp, store_key, g, rtt_ms)
                status.update(f"{where}: starting an engine")
                # every chunk in the row's codec: no cheaper codec for a saver that falls behind
                engine = Engine(url, codec, max_model_len=max_len, chunk_size=chunk_size, save_codec_when_behind=None,
                                load_wait=load_wait, **extra)
                if store_key not in populated:
                    status.update(f"{where}: computing and saving the prefix")
                    t0 = time.perf_counter()
                    engine.generate(prompts[0], 1)
                    engine.flush()
                    saved = engine.stats()
                    populated[store_key] = {
                        "seconds": time.perf_counter() - t0,
                        "saved_tokens": int(saved.get("saved_tokens", 0)),
                        "saved_bytes": int(saved.get("saved_bytes", 0)),
                        "saved_raw_bytes": int(saved.get("saved_raw_bytes", 0)),
                        "encode_s": saved.get("encode_s", 0.0),
                        "put_s": saved.get("put_s", 0.0),
                        "codecs": _codecs_used(saved, "saves"),
                        "save_failures": int(saved.get("save_failures", 0) + saved.get("saves_dropped", 0)),
                    }
                status.update(f"{where}: measuring TTFT")
                engine.reset_prefix_cache()
                first_load = engine.generate(prompts[1], 1)[0]  # the first load in this engine (untimed below)
                ttfts, loads, local, cpu = [], [], [], []
                for p in prompts[2 : 2 + repeats]:
                    engine.reset_prefix_cache()
                    before = engine.stats()
                    ttfts.append(engine.generate(p, 1)[0])
                    cpu.append(engine.last_cpu_s)
                    loads.append(_delta(engine.stats(), before))
                    local.append(engine.generate(p, 1)[0])  # the same prompt again: a local hit in this engine
                engine.close()
                engine = None
                row = _row(name, g, ttfts, loads, populated[store_key], baseline, expected_hit)
                row["precision"] = extra.get("precision", LOSSLESS)
                row["label"] = ttft_precision.label(name, row["precision"])
                row["precision_reads"] = ttft_precision.reads(loads)
                row["local_hit_s"], row["local_hit_all_s"] = _median(local), local
                row["over_local"] = _median([t / h for t, h in zip(ttfts, local)])
                row.update(cpu_floor(cpu, local))
                row["first_load_s"] = first_load
                row["first_in_process"] = not rows
                rows.append(row)
                console.log(f"{row['label']:>9} @ {g:>5g} Gbit/s: TTFT {row['ttft_s'] * 1000:.0f} ms, "
                            f"loaded {row['loaded_tokens']} tokens ({row['loaded_codecs']}), prefill waited for "
                            f"{row['waited_whole']} of {len(row['ttft_all_s'])} whole loads")
            if replay and not replay_only:
                replay_rows = replay_bench.run(_replay_codecs(codecs), prompts[0], tmp, max_len, chunk_size, replay_repeats,
                                               load_wait, status)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    lossless = [r for r in rows if r["precision"] == LOSSLESS]  # the codec targets are about lossless codecs
    targets = _targets(lossless, baseline, links) if lossless else {}
    if rows:  # the first connector engine of this process: numba's cache was empty if fresh_numba
        first = rows[0]
        targets[f"first load / steady load ({first['codec']} @ {first['gbps']:g} Gbit/s, "
                f"{'empty' if fresh_numba else 'warm'} numba cache)"] = _t(first["first_load_s"] / first["ttft_s"], "<=", 1.2)
    if replay_rows:
        targets.update(replay_bench.targets(replay_rows))
    result = {
        "benchmark": "ttft",
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "model": "SmolLM2-135M-Instruct (bf16, vLLM CPU)",
        "prefix_tokens": prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "chunk_size": chunk_size,
        "rtt_ms": rtt_ms,
        "numba_cache_empty_at_start": fresh_numba,
        "repeats": repeats,
        "replay_repeats": replay_repeats,
        "load_wait": load_wait,
        "baseline": baseline,
        "results": rows,
        "replay": replay_rows,
        "targets": targets,
        **({"precision": {**ttft_precision.summarize(rows, scale), "scaling": scale}} if levels else {}),
        "seconds": time.perf_counter() - started,
    }
    _print(result)
    if levels:
        ttft_precision.print_summary(result)
    write_json(result, output)
    return result


_RUN = uuid.uuid4().hex[:12]


def precision_settings(precisions: list[str] | None, paper_scale: bool | None, gbps: list[float] | None,
                       replay_only: bool) -> tuple[list[str], bool]:
    """The precision levels asked for, and whether the links are the paper's scaled (by default: with levels and no
    ``gbps``); a ConfigError where they cannot run."""
    levels = ttft_precision.parse_levels(precisions or [])
    paper_scale = bool(levels) and not gbps if paper_scale is None else paper_scale
    if (paper_scale or levels) and replay_only:
        raise ConfigError("--replay-only measures no links: it takes neither --precision nor --paper-scale")
    return levels, paper_scale


def _baselines(prompts: list[list[int]], repeats: int, max_len: int, status: Any) -> dict[str, Any]:
    """TTFT without the connector: the whole prompt recomputed, and the prefix from vLLM's local prefix cache."""
    from vllm_kvcodec.tools.demo import Engine

    status.update("baseline engine (no connector): starting")
    engine = Engine(None, max_model_len=max_len)
    status.update("baseline: recompute TTFT")
    engine.generate(prompts[0], 1)  # warm-up at full length
    recompute, local, local_cpu = [], [], []
    for p in prompts[2 : 2 + repeats]:
        engine.reset_prefix_cache()
        recompute.append(engine.generate(p, 1)[0])
    status.update("baseline: local prefix-cache hit TTFT (suffix prefill only)")
    for p in prompts[2 : 2 + repeats]:
        local.append(engine.generate(p, 1)[0])  # the prefix's blocks stay cached
        local_cpu.append(engine.last_cpu_s)
    engine.close()
    baseline = {"recompute_s": _median(recompute), "recompute_all_s": recompute,
                "local_hit_s": _median(local), "local_hit_all_s": local, "local_hit_cpu_s": _median(local_cpu)}
    console.log(f"recompute TTFT {baseline['recompute_s'] * 1000:.0f} ms, "
                f"local prefix-cache hit {baseline['local_hit_s'] * 1000:.0f} ms "
                f"({baseline['local_hit_cpu_s'] * 1000:.0f} CPU-ms on {usable_cores()} cores)")
    return baseline


def _replay_codecs(codecs: list[Any]) -> list[tuple[str, Any]]:
    """The replay's codecs: all measured ones but video (too slow to encode for a replay row)."""
    return [(_name(c), c) for c in codecs if _name(c) != "video"]


def _fresh_numba_cache() -> bool:
    """Point numba at an empty cache (a new container's first start), unless numba is loaded or the user set one.

    The first connector engine then compiles its kernels while it starts
    (``warm_up``), and its first load shows whether any compile is left on the
    request path (the ``first load / steady load`` target).
    """
    import sys

    if "numba" in sys.modules or "NUMBA_CACHE_DIR" in os.environ:
        return False
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvcodec-ttft-numba-")
    return True


def _plan_url(store: str | None, tmp: Path, store_key: str, g: float, rtt_ms: float) -> str:
    """One plan's store behind the emulated link: its own directory, or its own key prefix on ``store``."""
    link = {"gbps": f"{g:g}", "rtt_ms": f"{rtt_ms:g}"}
    if store is None:
        return with_query(f"link+file://{tmp / store_key.replace('/', '_')}", link)
    base, options = split_query(store)
    options["prefix"] = f"{options.get('prefix', '')}kvcodec-ttft/{_RUN}/{store_key.replace('/', '_')}/"
    return with_query(f"link+{base}", {**options, **link})


def _row(name: str, g: float, ttfts: list[float], loads: list[dict[str, float]], saved: dict[str, Any],
         baseline: dict[str, Any], expected_hit: int) -> dict[str, Any]:
    def per_load(key: str) -> float:
        return _median([d.get(key, 0.0) for d in loads])

    loaded_bytes = per_load("loaded_bytes")
    ttft = _median(ttfts)
    wire = loaded_bytes * 8 / (g * 1e9)
    local = baseline["local_hit_s"]
    return {
        "codec": name,
        "gbps": g,
        "ttft_s": ttft,
        "ttft_all_s": ttfts,
        "loaded_tokens": int(per_load("loaded_tokens")),
        "expected_tokens": expected_hit,
        "full_hit": all(int(d.get("loaded_tokens", 0)) == expected_hit for d in loads),
        "load_failures": int(sum(d.get("load_failures", 0) + d.get("load_timeouts", 0) for d in loads)),
        "loaded_bytes": int(loaded_bytes),
        "loaded_raw_bytes": int(per_load("loaded_raw_bytes")),
        "loaded_codecs": _codecs_used({k: v for d in loads for k, v in d.items()}, "loads"),
        "ratio": per_load("loaded_raw_bytes") / loaded_bytes if loaded_bytes else 0.0,
        "fetch_s": per_load("fetch_s"),
        "decode_s": per_load("decode_s"),
        "scatter_s": per_load("scatter_s"),
        "waited_whole": int(sum(d.get("load_waits_whole", 0) for d in loads)),  # timed loads the prefill waited out
        "wire_s": wire,
        "overlap": {"ttft_s": ttft, "max_s": max(wire, local), "sum_s": wire + local},
        "vs_recompute": ttft / baseline["recompute_s"],
        "save": saved,
    }


def _t(value: float | None, op: str, target: float) -> dict[str, Any]:
    if value is None:
        return {"value": None, "target": f"{op} {target}", "met": False}
    met = value <= target if op == "<=" else value >= target
    return {"value": value, "target": f"{op} {target}", "met": met}


def _targets(rows: list[dict[str, Any]], baseline: dict[str, Any], links: list[float]) -> dict[str, Any]:
    """The load path's targets, each on the rows' in-engine ratios to the local hit (``over_local``)."""
    by = {(r["codec"], r["gbps"]): r for r in rows if r["full_hit"]}
    out: dict[str, Any] = {}
    fixed = {g: [r for (c, gg), r in by.items() if gg == g and c != "auto"] for g in links}
    fast = max(links)
    if fixed[fast]:  # the best of every row at that speed, auto's included
        best = min((r for (_, g), r in by.items() if g == fast), key=lambda r: r["over_local"])
        out[f"TTFT(best={best['codec']}) / TTFT(local hit) at {fast:g} Gbit/s"] = _t(best["over_local"], "<=", 1.3)
    for g, target in ((10.0, 0.85), (1.0, 0.70)):
        raw, codecs = by.get(("raw", g)), [r for r in fixed.get(g, []) if r["codec"] != "raw"]
        if raw and codecs:
            best = min(codecs, key=lambda r: r["over_local"])
            out[f"TTFT(best={best['codec']}) / TTFT(raw) at {g:g} Gbit/s"] = _t(best["over_local"] / raw["over_local"], "<=", target)
    for g in links:
        auto = by.get(("auto", g))
        if auto and fixed[g]:
            best = min(fixed[g], key=lambda r: r["over_local"])
            out[f"TTFT(auto) / TTFT(best fixed={best['codec']}) at {g:g} Gbit/s"] = _t(auto["over_local"] / best["over_local"], "<=", 1.05)
            # The same comparison on the fixed row of the codec auto chose: its choice, free of the spread between
            # engines (two engines loading the same codec differed by up to 40% on a 2-core VM).
            chosen = by.get((auto["save"]["codecs"], g))
            if chosen is not None:
                out[f"TTFT({chosen['codec']}: auto's choice) / TTFT(best fixed={best['codec']}) at {g:g} Gbit/s"] = \
                    _t(chosen["over_local"] / best["over_local"], "<=", 1.05)
    slow = min(links)
    if fixed[slow] and baseline.get("recompute_s"):
        best = min(fixed[slow], key=lambda r: r["ttft_s"])
        out[f"TTFT(best={best['codec']}) / TTFT(recompute) at {slow:g} Gbit/s"] = _t(best["ttft_s"] / baseline["recompute_s"], "<=", 0.3)
    return out


def _print(result: dict[str, Any]) -> None:
    if result["results"]:
        _print_loads(result)
    if result["replay"]:
        wide_table(f"replay: the whole {result['prefix_tokens'] + result['suffix_tokens']}-token prompt again from the "
               "local disk (no link emulator), vLLM's prefix cache reset before each, each replay paired with a local "
               "hit of the same prompt in the same engine (÷local hit: the median of the pairs' ratios); vLLM's "
               "ExampleConnector beside this connector",
               ["served by", "TTFT ms", "local hit ms", "cached", "computed", "÷local hit", "CPU floor", "÷ExampleConnector"],
               replay_bench.table_rows(result["replay"]))
    for name, t in result["targets"].items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        console.print(f"{name}: {value} (target {t['target']}) " + ("[green]met[/green]" if t["met"] else "[red]NOT met[/red]"))


def _print_loads(result: dict[str, Any]) -> None:
    b = result["baseline"]
    rows = result["results"]
    raw = {r["gbps"]: r["over_local"] for r in rows if r["codec"] == "raw"}
    wide_table(
        f"TTFT: SmolLM2-135M, {result['machine']['cores']} CPU cores, {result['prefix_tokens']}-token stored prefix "
        f"+ {result['suffix_tokens']}-token suffix, link RTT {result['rtt_ms']:g} ms; "
        f"recompute {b['recompute_s'] * 1000:.0f} ms, local prefix-cache hit {b['local_hit_s'] * 1000:.0f} ms",
        ["codec", "Gbit/s", "TTFT ms", "local hit ms", "÷local hit", "CPU floor", "÷raw", "1st load ms", "÷recompute",
         "ratio", "wire ms", "fetch s", "decode s", "scatter s"],
        [[_label(r), f"{r['gbps']:g}", f"{r['ttft_s'] * 1000:.0f}" + ("" if r["full_hit"] else " (!)"),
          f"{r['local_hit_s'] * 1000:.0f}", f"{r['over_local']:.2f}", f"{r['floor_over_local']:.2f}",
          f"{r['over_local'] / raw[r['gbps']]:.2f}" if r["gbps"] in raw else "-",
          f"{r['first_load_s'] * 1000:.0f}",
          f"{r['vs_recompute']:.2f}", f"{r['ratio']:.3f}", f"{r['wire_s'] * 1000:.0f}",
          f"{r['fetch_s']:.3f}", f"{r['decode_s']:.3f}", f"{r['scatter_s']:.3f}"] for r in rows],
    )
    console.print("local hit: the same prompt again right after each load, in the same engine; ÷local hit and "
                  "÷raw: medians of those pairs' ratios (engines started minutes apart differ by up to 2x here)")
    console.print(f"CPU floor: the load's CPU-seconds (this process, every thread) over the {usable_cores()} usable "
                  "cores, over the paired local hit: no overlap can bring ÷local hit below it, only less work "
                  f"(the local hit spent {b.get('local_hit_cpu_s', 0) * 1000:.0f} CPU-ms)")
    console.print("1st load: the first load of that engine (not in the median); in the first engine of the run "
                  "it is a fresh process's first load")
    console.print("fetch/decode/scatter: the connector's seconds for one load, summed over its threads; "
                  "wire: stored bytes at the link's bandwidth; (!): not the whole prefix was loaded")
    wide_table(
        "overlap: TTFT with a hit vs max(wire time, suffix prefill) vs their sum "
        f"(suffix prefill = local prefix-cache hit, {b['local_hit_s'] * 1000:.0f} ms)",
        ["codec", "Gbit/s", "TTFT ms", "max ms", "sum ms", "decode+scatter s", "verdict"],
        [[_label(r), f"{r['gbps']:g}", f"{r['ttft_s'] * 1000:.0f}", f"{r['overlap']['max_s'] * 1000:.0f}",
          f"{r['overlap']['sum_s'] * 1000:.0f}", f"{r['decode_s'] + r['scatter_s']:.3f}", _verdict(r)] for r in rows],
    )
    console.print("verdict: 'overlapped' = TTFT within 5% of the max; 'N% hidden' = that share of the smaller term is "
                  "hidden under the larger; '+N ms beyond serial' = slower than wire + prefill back to back (the "
                  "excess is CPU work: decode, scatter and threads competing with the prefill for the cores)")
    bad = [r for r in rows if not r["full_hit"] or r["load_failures"]]
    for r in bad:
        console.print(f"[red]{r['codec']} @ {r['gbps']:g}: loaded {r['loaded_tokens']} of {r['expected_tokens']} tokens, "
                      f"{r['load_failures']} load failures/timeouts[/red]")
    la = result["load_average_before"][0]
    if la > 0.7:
        console.print(f"[yellow]measured on a busy machine (load average {la:.2f} before the run): other processes slow "
                      "the full prefill (recompute) far more than a load, so the ÷recompute figures flatter the "
                      "connector[/yellow]")
    console.print(f"[dim]{result['seconds']:.0f} s; load average before the run {la:.2f}[/dim]")


def _label(r: dict[str, Any]) -> str:
    """The codec asked for, and what it saved with when that differs (auto)."""
    used = r["save"]["codecs"]
    name = r["codec"] if used == r["codec"] else f"{r['codec']}→{used}"
    return name if r.get("precision", LOSSLESS) == LOSSLESS else f"{name} ({LOSSY_LABEL})"


def _verdict(r: dict[str, Any]) -> str:
    o = r["overlap"]
    if o["ttft_s"] <= 1.05 * o["max_s"]:
        return "overlapped"
    if o["ttft_s"] < o["sum_s"]:
        return f"{(o['sum_s'] - o['ttft_s']) / (o['sum_s'] - o['max_s']) * 100:.0f}% hidden"
    return f"+{(o['ttft_s'] - o['sum_s']) * 1000:.0f} ms beyond serial"
