"""``kvcodec bench serve``: vLLM's own load client against real ``vllm serve`` processes, with and without the connector.

What a saving instance costs its own requests, and what a loading one gains,
can only be told apart from noise at saturation and over repeats (two
identical no-connector runs at 2 requests/s differed 5x in median TTFT). So
every repeat runs three servers one after another, in a rotating order (drift
in the machine's load then falls on each kind alike):

- ``none``: ``vllm serve`` without a connector;
- ``save``: ``kvcodec serve`` saving into an empty store (a fresh directory or
  key prefix per repeat);
- ``load``: a fresh ``kvcodec serve`` on the store the ``save`` server of the
  same repeat filled (that server was stopped with SIGTERM first, so its
  queued saves were flushed: ``kvcodec serve`` sets the shutdown bound).

The client is ``vllm bench serve --dataset-name prefix_repetition`` (defaults:
4 prefixes of 1500 tokens, suffix 64, output 8, 48 prompts, seed 42, all sent
at once). Per run: TTFT mean / median / p99, request throughput, failed
requests (vLLM's own figures, from its ``--save-result`` JSON), the server's
CPU seconds per completed request (its whole process tree), and the
connector's counters from ``/metrics``; after a ``save`` run, the objects that
landed in the store are counted. Means over the repeats and the ratios
against ``none`` are printed and written as JSON.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from vllm_kvcodec.tools.bench.report import console, machine, wide_table, write_json

KINDS = ("none", "save", "load")
PREFIX = "vllm:kvcodec_"


def run(
    output: Path | None = Path("bench-results/serve.json"),
    repeats: int = 2,
    codec: str = "rans",
    store: str | None = None,
    num_prompts: int = 48,
    prefix_len: int = 1500,
    suffix_len: int = 64,
    num_prefixes: int = 4,
    output_len: int = 8,
    request_rate: str = "inf",
    seed: int = 42,
    save_thread_nice: int = 0,
    codec_when_behind: str | None = "splitzip",
    upgrade: bool = True,
    link: str | None = None,
    lookups: tuple[str, ...] = (),
    prefetches: tuple[int, ...] = (),
    baseline: bool | None = None,
    save_lookups: tuple[str, ...] = (),
) -> dict[str, Any]:
    from vllm_kvcodec.tools.smollm2 import model_dir

    started = time.perf_counter()
    model = str(model_dir())
    tmp = Path(tempfile.mkdtemp(prefix="kvcodec-serve-"))
    client = _client_args(model, num_prompts, prefix_len, suffix_len, num_prefixes, output_len, request_rate, seed)
    connector = {"codec": codec, "save_thread_nice": save_thread_nice, "save_codec_when_behind": codec_when_behind,
                 "upgrade_fallback_chunks": upgrade}
    runs: list[dict[str, Any]] = []
    try:
        for r in range(repeats):
            url = _store_url(store, tmp, r, link)
            for kind in run_order(r, lookups, prefetches, baseline, save_lookups):
                console.log(f"[{r + 1}/{repeats}] {kind}: starting a server")
                own = _store_url(store, tmp, f"{r}-{kind}", link) if kind.startswith("save-") else url  # empty too
                result = _one_run(kind, model, own, connector, client, tmp / f"r{r}-{kind}")
                result["repeat"] = r
                runs.append(result)
                console.log(f"[{r + 1}/{repeats}] {kind}: {result['request_throughput']:.2f} req/s, TTFT mean "
                            f"{result['mean_ttft_ms']:.0f} ms, {result['failed']} failed"
                            + (f", {result['stored_objects']} objects stored" if kind.startswith("save") else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = _summary(runs)
    result = {"benchmark": "serve", "machine": machine(), "codec": codec, "save_thread_nice": save_thread_nice,
              "save_codec_when_behind": codec_when_behind, "upgrade_fallback_chunks": upgrade,
              "store": store or "file (temporary)", "link": link, "lookups": list(lookups),
              "prefetches": list(prefetches),
              "client": {"dataset": "prefix_repetition", "num_prompts": num_prompts, "prefix_len": prefix_len,
                         "suffix_len": suffix_len, "num_prefixes": num_prefixes, "output_len": output_len,
                         "request_rate": request_rate, "seed": seed},
              "repeats": repeats, "runs": runs, "summary": summary, "seconds": time.perf_counter() - started}
    _print(result)
    write_json(result, output)
    return result


def run_order(r: int, lookups: tuple[str, ...], prefetches: tuple[int, ...], baseline: bool | None,
              save_lookups: tuple[str, ...]) -> tuple[str, ...]:
    """The servers of repeat ``r``, in turns: a loading server right after the save that fills its store; saving
    servers per lookup mode (``save-sync``) next to the default one, each into an empty store of its own."""
    order: tuple[str, ...] = KINDS if r % 2 == 0 else ("save", "load", "none")
    if lookups or prefetches:  # one loading server per variant, in turns, after the save that fills their store
        variants = load_variants(lookups, prefetches)
        order = ("save", *(variants if r % 2 == 0 else reversed(variants)))
        if baseline:
            order = ("none", *order) if r % 2 == 0 else (*order, "none")
    elif baseline is False:
        order = ("save", "load")
    saves = [f"save-{mode}" for mode in save_lookups]
    out: list[str] = []
    for kind in order:
        if kind == "save":  # the loading servers after it read what it saved: keep them next to it
            out += [kind, *saves] if r % 2 == 0 else [*saves, kind]
        else:
            out.append(kind)
    return tuple(out)


def load_variants(lookups: tuple[str, ...], prefetches: tuple[int, ...]) -> list[str]:
    """The loading servers to compare: one per lookup mode and prefetch budget (``load-sync``,
    ``load-prefetch=0``, ``load-async,prefetch=268435456``)."""
    out = []
    for mode in lookups or (None,):
        for budget in prefetches or (None,):
            parts = ([mode] if mode else []) + ([f"prefetch={budget}"] if budget is not None else [])
            out.append("load-" + ",".join(parts))
    return out


def _variant_config(kind: str) -> dict[str, Any]:
    """What a ``load-...`` or ``save-...`` kind sets in its server's connector config."""
    out: dict[str, Any] = {}
    for part in kind.split("-", 1)[1].split(",") if kind.startswith(("load-", "save-")) else ():
        name, _, value = part.partition("=")
        if name == "prefetch":
            out["prefetch_bytes"] = int(value)
        else:
            out["lookup"] = name
    return out


def _client_args(model: str, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                 output_len: int, request_rate: str, seed: int) -> list[str]:
    from vllm_kvcodec.tools.server_process import SERVED_NAME

    return ["bench", "serve", "--backend", "vllm", "--model", model, "--tokenizer", model,
            "--served-model-name", SERVED_NAME, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix_len), "--prefix-repetition-suffix-len", str(suffix_len),
            "--prefix-repetition-num-prefixes", str(num_prefixes), "--prefix-repetition-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--request-rate", request_rate, "--seed", str(seed), "--ignore-eos",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]


def _store_url(store: str | None, tmp: Path, repeat: int | str, link: str | None = None) -> str:
    """An empty store per repeat: a new directory (behind the link emulator with ``link``), or a new key prefix on ``store``."""
    if store is None:
        return f"link+file://{tmp / f'store-{repeat}'}?{link}" if link else f"file://{tmp / f'store-{repeat}'}"
    from storage.options import split_query, with_query

    base, options = split_query(store)
    options["prefix"] = f"{options.get('prefix', '')}kvcodec-bench-serve/{uuid.uuid4().hex[:12]}/"
    return with_query(base, options)


def engine_args(block_size: int = 128, max_model_len: int = 2048) -> list[str]:
    """The engine settings every server of a comparison shares (bf16, eager, vLLM's prefix cache on)."""
    from vllm_kvcodec.tools.server_process import SERVED_NAME

    return ["--dtype", "bfloat16", "--block-size", str(block_size), "--enforce-eager", "--max-model-len",
            str(max_model_len), "--enable-prefix-caching", "--served-model-name", SERVED_NAME]


def _server_argv(kind: str, model: str, url: str, connector: dict[str, Any],
                 engine: list[str] | None = None) -> list[str]:
    """``vllm serve`` (kind ``none``) or ``kvcodec serve`` on ``url``, with ``engine`` (default :func:`engine_args`)."""
    from vllm_kvcodec.tools.serve import plan_serve

    engine = engine_args() if engine is None else engine
    if kind == "none":
        return ["-m", "vllm_kvcodec.tools.vllm_cli", "serve", model, *engine]
    plan = plan_serve(model, {"store": url, "log_interval_s": 0, **connector, **_variant_config(kind)}, engine)
    return ["-m", "vllm_kvcodec.tools.vllm_cli", *plan.argv]


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": env.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "20")})
    return env


def _one_run(kind: str, model: str, url: str, connector: dict[str, Any], client: list[str], work: Path) -> dict[str, Any]:
    from vllm_kvcodec.tools.bench.client_process import started_client
    from vllm_kvcodec.tools.server_process import running

    work.mkdir(parents=True, exist_ok=True)
    argv, env = _server_argv(kind, model, url, connector), _server_env()
    # the client imports vLLM while the server starts (client_process.py); it runs once the server answers
    with started_client(work, env) as waiting, running(argv, work / "server.log", env, start_timeout=600) as server:
        cpu0 = _tree_cpu_s(server.proc.pid)
        figures = _figures(waiting.result(server.url, client))
        cpu = _tree_cpu_s(server.proc.pid) - cpu0
        counters = _counters(server.metrics()) if kind != "none" else {}
        server.terminate(120)  # SIGTERM: kvcodec serve's shutdown bound lets queued saves land
    figures.update(kind=kind, server_cpu_s=cpu, cpu_s_per_request=cpu / max(1, figures["completed"]),
                   counters=counters)
    if kind != "none":  # after a load run too: its idle saver upgrades fallback-coded objects it loaded
        figures.update(_stored(url))
    return figures


def _figures(raw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own result JSON, trimmed to the figures compared here."""
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "p99_e2el_ms")
    return {k: raw.get(k) for k in keep}


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the engine core runs in one)."""
    import psutil

    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def _counters(scrape: dict[tuple[str, frozenset], float]) -> dict[str, float]:
    """The connector's counters from a /metrics scrape, summed over engines (and labels, keyed ``name{label}``), and
    its histograms' sums and counts (``name_sum``, ``name_count``)."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape.items():
        if not name.startswith(PREFIX) or not name.endswith(("_total", "_sum", "_count")):
            continue
        short = name[len(PREFIX) :].removesuffix("_total")
        extra = {k: v for k, v in labels if k not in ("engine", "model_name")}
        key = short + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
        out[key] = out.get(key, 0.0) + value
    return out


def _stored(url: str) -> dict[str, Any]:
    """What the store holds: objects, their bytes, and the raw KV bytes their headers say they hold."""
    from storage import open_store
    from vllm_kvcodec.keys.block_refs import is_ref_key
    from vllm_kvcodec.format import read_header

    objects = stored = raw = 0
    with open_store(url, read_only=True) as store:
        for key in store.keys():
            blob = None if is_ref_key(key) else store.get(key)  # block refs: an index, no chunk header
            if blob is None:
                continue
            objects, stored, raw = objects + 1, stored + len(blob), raw + read_header(blob, verify=False).raw_nbytes
    return {"stored_objects": objects, "stored_bytes": stored, "stored_ratio": raw / stored if stored else 0.0}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        if not mine:
            continue
        out[kind] = {k: statistics.fmean(r[k] for r in mine) for k in
                     ("request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "cpu_s_per_request")}
        out[kind]["failed"] = sum(r["failed"] for r in mine)
        out[kind]["runs"] = len(mine)
    if "none" in out:
        base = out["none"]["request_throughput"]
        for kind in out:
            if kind != "none":
                out[kind]["throughput_vs_none"] = out[kind]["request_throughput"] / base
    return out


def _print(result: dict[str, Any]) -> None:
    c = result["client"]
    rows = []
    for r in result["runs"]:
        k = r["counters"]
        rows.append([f"{r['kind']} #{r['repeat'] + 1}", f"{r['request_throughput']:.2f}", f"{r['mean_ttft_ms']:.0f}",
                     f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}", str(r["failed"]),
                     f"{r['cpu_s_per_request']:.3f}",
                     f"{k.get('encode_seconds', 0) / max(1, r['completed']):.3f}" if k else "-",
                     f"{k.get('saved_chunks', 0):.0f}" if k else "-", f"{k.get('saves_behind', 0):.0f}" if k else "-",
                     str(r.get("stored_objects", "-")),
                     f"{r['stored_ratio']:.3f}" if r.get("stored_ratio") else "-",
                     f"{k.get('upgraded_objects', 0):.0f}" if k else "-", f"{k.get('loaded_tokens', 0):.0f}" if k else "-",
                     f"{sum(v for n, v in k.items() if n.startswith('load_failures')):.0f}" if k else "-"])
    wide_table(f"vllm bench serve, prefix_repetition: {c['num_prefixes']} prefixes x {c['prefix_len']} tokens, "
               f"suffix {c['suffix_len']}, output {c['output_len']}, {c['num_prompts']} prompts at rate "
               f"{c['request_rate']}; codec {result['codec']}, store {result['store']}",
               ["run", "req/s", "TTFT ms", "med ms", "p99 ms", "failed", "CPU-s/req", "enc s/req", "saved", "behind",
                "objects", "ratio", "upgraded", "loaded tok", "load fail"], rows)
    console.print("TTFT: mean; enc s/req: the save threads' encode seconds per request; saved: chunks the connector "
                  "counted saved when the client finished (a worker reports with the engine's steps, so saves landing "
                  "after the last step are missing), behind: of them, encoded while a round of saves waited "
                  f"(with {result['save_codec_when_behind'] or 'the same codec'}); objects, ratio: what the store held after "
                  "the server stopped (its shutdown flushes queued saves), raw KV over stored bytes; upgraded: objects "
                  "the loading server re-encoded with the configured codec after loading them (upgrade_fallback_chunks)")
    for r in result["runs"]:
        k = r["counters"]
        if k.get("lookups"):
            trips = k.get("lookup_round_trip_seconds_count", 0)
            rtt = f", store answered a lookup batch in {k['lookup_round_trip_seconds_sum'] / trips * 1e3:.2f} ms" if trips else ""
            console.print(f"{r['kind']} #{r['repeat'] + 1} lookups: {k['lookups']:.0f}, answered within their step "
                          f"{k.get('lookups_answered_in_step', 0):.0f}, retries {k.get('lookup_retries', 0):.0f}, "
                          f"scheduler waited {k.get('lookup_wait_seconds', 0) * 1e3:.1f} ms, steps inline / thread "
                          f"{k.get('lookup_steps{mode=inline}', 0):.0f} / {k.get('lookup_steps{mode=thread}', 0):.0f}{rtt}")
    for kind, s in result["summary"].items():
        vs = f", throughput {s['throughput_vs_none']:.2f}x none" if "throughput_vs_none" in s else ""
        console.print(f"{kind}: mean of {s['runs']}: {s['request_throughput']:.2f} req/s, TTFT mean "
                      f"{s['mean_ttft_ms']:.0f} ms, median {s['median_ttft_ms']:.0f}, p99 {s['p99_ttft_ms']:.0f}, "
                      f"{s['cpu_s_per_request']:.3f} CPU-s/request, {s['failed']} failed{vs}")
    console.print(f"[dim]{result['seconds']:.0f} s[/dim]")
