"""``kvcodec bench trace``: a production trace replayed through vLLM's router and client on a fleet of real servers.

One command starts, per configuration and from cold (a new Redis, new
workers): K workers (``vllm serve``, or ``kvcodec serve`` on that Redis,
optionally behind the link emulator), each publishing its KV events,
``vllm-router`` in front, and replays the trace through the router with
``vllm bench serve --dataset-name timed_trace`` (``PYTHONHASHSEED`` fixed, so
every configuration sees the same prompts). Configurations:

- ``a``: no connector, ``round_robin``; ``b``: no connector, ``cache_aware``
  (what a fleet gets today from local caches alone);
- ``c``: the connector, ``round_robin``;
- ``d``: the connector, ``kv_aware``, fed by every worker's events, including
  the connector's ``BlockStored`` for the store (ownership ``kvcodec``: the
  router's External tier) fanned out to every worker (:mod:`.event_relay`),
  since any of them can load what one stored;
- ``e``: ``c`` with a near tier (``cache+``, memory) in each worker.

Scaled by flags: tokens per id (every prompt shrinks by the same factor, the
reuse structure stays), the first N requests or a time window, a time
multiplier, answers capped. Per configuration: prompt tokens computed, from
vLLM's local cache, loaded by the connector (vLLM's counters and each
request's own, from :mod:`.request_ledger`), that hit share against the
trace's ceiling for the same requests, TTFT p50/p99, requests/s, failed
requests, far-store bytes read per request, bytes stored and their ratio.
Then the simulator is given the same requests, capacities and each request's
worker, and its per-request split is compared with the measured one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_kvcodec.tools.bench import serve
from vllm_kvcodec.tools.bench.report import console, machine, wide_table, write_json
from vllm_kvcodec.tools.bench.trace_file import (
    DEFAULT_TRACE,
    TraceRequest,
    ceiling_tokens,
    prompt_length,
    read_trace,
    select,
    write_trace,
)

#: Configuration -> (what it is, connector on, router policy, near tier).
CONFIGS: dict[str, tuple[str, bool, str, bool]] = {
    "a": ("no connector, round_robin", False, "round_robin", False),
    "b": ("no connector, cache_aware", False, "cache_aware", False),
    "c": ("connector, round_robin", True, "round_robin", False),
    "d": ("connector, kv_aware (store events to every worker)", True, "kv_aware", False),
    "e": ("connector + near tier, round_robin", True, "round_robin", True),
}
OWNERSHIP = "kvcodec"  # the connector's kv_events_ownership default: the router's External tier
REQUEST_PREFIX = "trace-"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class MissingPart(RuntimeError):
    """Something the replay needs is not installed or not there (one line says what)."""


@dataclasses.dataclass(frozen=True)
class ReplaySpec:
    trace: Path = DEFAULT_TRACE
    first: int | None = 40
    start_s: float = 0.0
    window_s: float | None = None
    tokens_per_id: int = 32
    speed: float = 1.0  # trace seconds per replay second
    max_output: int = 4
    workers: int = 2
    block_size: int = 32
    chunk_size: int = 256
    codec: str = "rans"
    link: str | None = None  # e.g. "gbps=10&rtt_ms=0.5": the store behind the link emulator
    near_bytes: str = "2GiB"  # per worker (memory): more than its KV cache (1 GiB), or it holds nothing the GPU cache lacks
    kv_cache_gib: int = 1
    configs: str = "abcde"
    hash_seed: int = 0
    kill_worker_after_s: float | None = None  # kill the last worker this long into each replay (failure test)
    client_timeout_s: float = 1800.0
    min_gap_s: float = 0.0  # space arrivals at least this far apart (replay seconds): each request done before the next
    work_dir: Path | None = None  # keep every log and ledger there (default: a temporary folder, removed)


def check_parts(spec: ReplaySpec) -> list[TraceRequest]:
    """Everything the replay needs, before anything starts (MissingPart with one line otherwise); the requests."""
    from storage.testing.redis_server import find_redis_server
    from vllm_kvcodec.tools.router_process import MISSING, find_router

    if not spec.trace.is_file():
        raise MissingPart(f"trace file {spec.trace} not found (give --trace PATH; the Mooncake trace is in "
                          f"../shared/data/traces/)")
    if find_router() is None:
        raise MissingPart(MISSING)
    if find_redis_server() is None:
        raise MissingPart("redis-server is not on PATH: apt-get install redis-server (make test installs it)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise MissingPart("vLLM is not installed: pip install 'vllm-kvcodec[cpu]' (or [gpu])") from None
    unknown = set(spec.configs) - set(CONFIGS)
    if unknown or not spec.configs:
        raise MissingPart(f"unknown configuration(s) {''.join(sorted(unknown))!r}; known: {''.join(CONFIGS)}")
    return requests_of(spec)  # every line checked (TraceError names the bad one) before any server starts


def requests_of(spec: ReplaySpec) -> list[TraceRequest]:
    """The replayed requests: from ``start_s``, within ``window_s``, the first ``first``; indexes from 0."""
    rows = select(read_trace(spec.trace), spec.trace, spec.start_s, spec.window_s, spec.first)
    t0, gap_ms, last = rows[0].timestamp_ms, spec.min_gap_s * 1000.0 * spec.speed, None
    out = []
    for i, r in enumerate(rows):
        ts = r.timestamp_ms - t0 if last is None else max(r.timestamp_ms - t0, last + gap_ms)
        out.append(dataclasses.replace(r, index=i, timestamp_ms=ts))
        last = ts
    return out


def run(spec: ReplaySpec, output: Path | None = Path("bench-results/trace.json")) -> dict[str, Any]:
    requests = check_parts(spec)
    from vllm_kvcodec.tools.smollm2 import model_dir

    started = time.perf_counter()
    model = str(model_dir())
    tmp = spec.work_dir or Path(tempfile.mkdtemp(prefix="kvcodec-trace-"))
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = [prompt_length(r, spec.tokens_per_id) for r in requests]
    ceiling = ceiling_tokens(requests, spec.tokens_per_id)
    results = []
    try:
        trace_path = write_trace(requests, tmp / "replayed.jsonl", spec.max_output)
        for name in spec.configs:
            console.log(f"configuration {name}: {CONFIGS[name][0]}")
            results.append(_one_config(name, spec, model, trace_path, len(requests), max(prompts), tmp / name))
        base = next((r for r in results if r["config"] == "a"), None)
        fit = fit_prefill(base, requests, spec) if base else None
        for result in results:
            result["comparison"] = compare_with_simulator(requests, spec, result,
                                                          fit or fit_prefill(result, requests, spec))
            _log_one(result, sum(ceiling) / sum(prompts))
    finally:
        if spec.work_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {"benchmark": "trace-replay", "machine": machine(), "spec": _spec_json(spec),
           "requests": len(requests), "prompt_tokens": sum(prompts), "ceiling_tokens": sum(ceiling),
           "ceiling_share": sum(ceiling) / sum(prompts), "configs": results,
           "seconds": time.perf_counter() - started}
    out["targets"] = targets(out)
    print_replay(out)
    write_json(compact(out), output)
    return out


#: Per-request lists the run returns but does not write (800 requests make a megabyte; --work-dir keeps the ledgers
#: and vLLM's client JSON they come from).
PER_REQUEST = ("per_request", "ttfts_s", "start_times", "e2els_s")


def compact(out: dict[str, Any]) -> dict[str, Any]:
    return {**out, "configs": [{k: v for k, v in c.items() if k not in PER_REQUEST} for c in out["configs"]]}


def _spec_json(spec: ReplaySpec) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(spec).items()}


# ---- one configuration ---------------------------------------------------------------------
def _one_config(name: str, spec: ReplaySpec, model: str, trace_path: Path, n: int, longest: int,
                work: Path) -> dict[str, Any]:
    from storage.testing.redis_server import start_redis_server
    from vllm_kvcodec.tools.bench.client_process import started_client

    what, connector, policy, near = CONFIGS[name]
    shutil.rmtree(work, ignore_errors=True)  # a kept folder from an earlier run: its ledgers would be appended to
    work.mkdir(parents=True)
    with start_redis_server(["--save", "", "--appendonly", "no"]) as redis, contextlib.ExitStack() as stack:
        far_url = redis.url
        url = _store_url(far_url, spec, near)
        max_len = -(-(longest + spec.max_output + 1) // spec.block_size) * spec.block_size
        client = stack.enter_context(started_client(work, _env(spec)))  # imports vLLM while the workers start
        workers = _start_workers(stack, spec, model, url if connector else None, max_len, work)
        sources, relay = [w.events for w in workers], None
        if policy == "kv_aware":
            from vllm_kvcodec.tools.bench.event_relay import StoreEventRelay

            relay = stack.enter_context(StoreEventRelay(sources, OWNERSHIP))
            sources = relay.endpoints
        router = stack.enter_context(_router(spec, model, workers, sources, policy, work))
        killed = _killer(workers[-1], spec.kill_worker_after_s)
        try:
            raw = client.result(router.url, _client_args(spec, model, trace_path, n), spec.client_timeout_s)
        finally:
            if killed is not None:
                killed.cancel()
        figures = _figures(raw)
        scraped = [_scrape(w) for w in workers]
        _parallel(_stop_worker, workers)
        stored = serve._stored(far_url) if connector else {}
    ledger = _ledger(workers, spec)
    return {"config": name, "what": what, "connector": connector, "policy": policy, "near_tier": near,
            "store_url": url if connector else None, **figures, **_sources(scraped, near), "per_request": ledger,
            "workers_killed": [w.index for w in workers if w.killed],
            "local_tokens": _local_tokens(scraped, workers, spec.block_size),
            "relayed_events": list(relay.forwarded) if relay else None, **stored}


def _store_url(far_url: str, spec: ReplaySpec, near: bool) -> str:
    url = f"link+{far_url}?{spec.link}" if spec.link else far_url
    if near:
        from urllib.parse import quote

        url = f"cache+{url}{'&' if '?' in url else '?'}near={quote('memory://', safe='')}&near_bytes={spec.near_bytes}"
    return url


@dataclasses.dataclass
class _Worker:
    index: int
    server: Any
    events: str
    ledger: Path
    killed: bool = False


def _env(spec: ReplaySpec) -> dict[str, str]:
    env = serve._server_env()
    env.update({"PYTHONHASHSEED": str(spec.hash_seed), "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib)})
    return env


def _parallel(fn: Any, items: list[Any]) -> list[Any]:
    """``fn`` over ``items`` at once (servers start and stop in parallel: each takes most of a minute here)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(items))) as pool:
        return list(pool.map(fn, items))


def _start_workers(stack: contextlib.ExitStack, spec: ReplaySpec, model: str, url: str | None, max_len: int,
                   work: Path) -> list[_Worker]:
    """Every worker started at once; each one that came up is stopped with ``stack``, whatever else failed."""
    managers = [_worker(i, spec, model, url, max_len, work) for i in range(spec.workers)]

    def enter(cm: Any) -> Any:
        try:
            return cm.__enter__(), None
        except BaseException as exc:  # noqa: BLE001 - raised below, once every start has ended
            return None, exc

    started = _parallel(enter, managers)
    for cm, (worker, _) in zip(managers, started):
        if worker is not None:
            stack.push(cm)
    for _, exc in started:
        if exc is not None:
            raise exc
    return [w for w, _ in started]


@contextlib.contextmanager
def _worker(i: int, spec: ReplaySpec, model: str, url: str | None, max_len: int, work: Path) -> Iterator[_Worker]:
    """One worker: plain ``vllm serve`` (url None) or ``kvcodec serve`` on ``url``; KV events on; its ledger."""
    from storage.testing.ports import reserved_port
    from vllm_kvcodec.tools.bench.request_ledger import LEDGER_ENV, SCHEDULER_CLS
    from vllm_kvcodec.tools.server_process import running

    port = reserved_port()
    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "topic": ""}' % port
    engine = [*serve.engine_args(spec.block_size, max_len), "--kv-events-config", events,
              "--scheduler-cls", SCHEDULER_CLS]
    connector = {"codec": spec.codec, "chunk_size": spec.chunk_size}
    argv = serve._server_argv("none" if url is None else "save", model, url or "", connector, engine)
    ledger = work / f"ledger-{i}.jsonl"
    env = _env(spec)
    # Two engines on two cores: one thread each, or their OpenMP teams fight (vllm-cpu slows ~20x).
    env.update({"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // spec.workers)), LEDGER_ENV: str(ledger)})
    with running(argv, work / f"worker-{i}.log", env, start_timeout=600) as server:
        yield _Worker(i, server, f"tcp://127.0.0.1:{port}", ledger)


@contextlib.contextmanager
def _router(spec: ReplaySpec, model: str, workers: list[_Worker], sources: list[str], policy: str,
            work: Path) -> Iterator[Any]:
    from vllm_kvcodec.tools.router_process import running_router

    urls = [w.server.url for w in workers]
    # No retries: a request a worker failed is counted failed, not sent again (which would hide a dead worker and
    # count its prefill twice).
    extra = ["--request-timeout-secs", str(int(spec.client_timeout_s)), "--disable-retries"]
    if policy == "kv_aware":
        for url, src in zip(urls, sources):
            extra += ["--kv-event-source", f"{url}={src}"]
        extra += ["--kv-event-block-size", str(spec.block_size), "--kv-event-model", model]
    with running_router(urls, policy, work / "router.log", extra) as router:
        yield router


def _client_args(spec: ReplaySpec, model: str, trace_path: Path, n: int) -> list[str]:
    from vllm_kvcodec.tools.server_process import SERVED_NAME

    return ["bench", "serve", "--backend", "vllm", "--model", model, "--tokenizer", model,
            "--served-model-name", SERVED_NAME, "--dataset-name", "timed_trace", "--dataset-path", str(trace_path),
            "--timed-trace-chunk-hash-size", str(spec.tokens_per_id),
            "--timed-trace-sec-multiplier", repr(0.001 / spec.speed), "--num-prompts", str(n),
            "--request-id-prefix", REQUEST_PREFIX, "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,99", "--save-detailed", "--disable-tqdm"]


def _killer(worker: _Worker, after_s: float | None) -> threading.Timer | None:
    """SIGKILL ``worker`` (its whole process group) ``after_s`` into the replay: a crashed host."""
    if after_s is None:
        return None

    def kill() -> None:
        console.log(f"killing worker {worker.index} (SIGKILL) mid-replay")
        worker.killed = True
        worker.server.kill()

    timer = threading.Timer(after_s, kill)
    timer.daemon = True
    timer.start()
    return timer


def _figures(raw: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "duration", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_e2el_ms", "p99_e2el_ms")
    out = {k: raw.get(k) for k in keep}
    out["ttfts_s"] = raw.get("ttfts", [])
    out["start_times"] = raw.get("start_times", [])
    out["e2els_s"] = [t + sum(i or []) for t, i in zip(out["ttfts_s"], raw.get("itls", []))]  # first token + the rest
    out["errors"] = [e for e in raw.get("errors", []) if e]
    return out


def _scrape(w: _Worker) -> dict[str, Any]:
    """A live worker's /metrics: vLLM's prompt tokens by source, the connector's counters, its KV capacity."""
    if w.killed:
        return {}
    try:
        samples = w.server.metrics()
    except OSError:
        return {}
    by_source = {s: 0.0 for s in SOURCES}
    blocks = None
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if name == "vllm:prompt_tokens_by_source_total" and labels.get("source") in by_source:
            by_source[labels["source"]] += value
        if name == "vllm:cache_config_info" and "num_gpu_blocks" in labels:
            blocks = int(labels["num_gpu_blocks"])
    return {"by_source": by_source, "counters": serve._counters(samples), "gpu_blocks": blocks}


def _sources(scraped: list[dict[str, Any]], near: bool) -> dict[str, Any]:
    """vLLM's prompt tokens by source and the connector's counters, summed over the workers still alive; the far
    store's bytes read are the near tier's far reads with one, every byte loaded without."""
    tokens = {s: sum(x.get("by_source", {}).get(s, 0.0) for x in scraped) for s in SOURCES}
    counters: dict[str, float] = {}
    for x in scraped:
        for k, v in x.get("counters", {}).items():
            counters[k] = counters.get(k, 0.0) + v
    total = sum(tokens.values()) or 1.0
    far = counters.get("tier_read_bytes{tier=far}", 0.0) if near else counters.get("loaded_bytes", 0.0)
    return {"tokens_by_source": tokens, "shares_vllm": {
                "local": tokens["local_cache_hit"] / total, "store": tokens["external_kv_transfer"] / total,
                "computed": tokens["local_compute"] / total},
            "connector_counters": counters, "far_bytes_read": far,
            "gpu_blocks": [x.get("gpu_blocks") for x in scraped]}


def _stop_worker(w: _Worker) -> None:
    """SIGTERM, as a supervisor stops it: kvcodec serve's shutdown bound lets queued saves land."""
    if not w.killed and w.server.proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.server.terminate(120)


def _ledger(workers: list[_Worker], spec: ReplaySpec) -> list[dict[str, Any]]:
    """Each replayed request's split as its worker's scheduler counted it, by trace index."""
    from vllm_kvcodec.tools.bench.request_ledger import read_ledger

    out = []
    for w in workers:
        for row in read_ledger(w.ledger):
            m = re.search(rf"{REQUEST_PREFIX}(\d+)", row["request_id"])
            if m is None:
                continue
            out.append({"index": int(m.group(1)), "worker": w.index, "prompt": row["prompt"], "local": row["local"],
                        "store": row["external"], "computed": row["prompt"] - row["local"] - row["external"],
                        "t": row["t"]})
    return sorted(out, key=lambda r: r["index"])


def _local_tokens(scraped: list[dict[str, Any]], workers: list[_Worker], block_size: int) -> int | None:
    """Each worker's KV cache in tokens: its blocks as its metrics report them (``vllm:cache_config_info``), or its
    log's 'KV cache size: N tokens' line. Not the log first: a worker started with ``VLLM_LOGGING_LEVEL=WARNING``
    (an environment the test harness sets, for one) never writes that line."""
    blocks = [x.get("gpu_blocks") for x in scraped]
    if blocks and all(blocks):
        return min(blocks) * block_size
    for w in workers:
        m = re.search(r"KV cache size: ([\d,]+) tokens", w.server.log())
        if m:
            return int(m.group(1).replace(",", ""))
    return None


# ---- the simulator on the replay's own requests ------------------------------------------------
def fit_prefill(result: dict[str, Any], requests: list[TraceRequest], spec: ReplaySpec) -> dict[str, Any] | None:
    """This machine's costs fitted to one configuration's TTFTs, queues included (:mod:`.trace_fit`)."""
    from vllm_kvcodec.tools.bench.trace_fit import fit_costs

    measured = {r["index"]: r for r in result["per_request"]}
    ttfts = result.get("ttfts_s") or []
    if len(measured) < len(requests) or len(ttfts) < len(requests) or result["workers_killed"]:
        return None
    rows = [measured[r.index] for r in requests]
    fit = fit_costs([r.timestamp_ms / 1000.0 / spec.speed for r in requests], [m["worker"] for m in rows],
                    [m["computed"] for m in rows], [m["local"] + m["store"] for m in rows],
                    [ttfts[r.index] for r in requests], spec.workers)
    return {**fit, "fitted_on": result["config"]}


def compare_with_simulator(requests: list[TraceRequest], spec: ReplaySpec, result: dict[str, Any],
                           fit: dict[str, float] | None = None) -> dict[str, Any]:
    """The simulator given this configuration's requests, capacities and routing: per-request agreement.

    Requests go through the simulator in the order their workers first
    scheduled them (the ledger's times), each on the worker it ran on. The
    simulator is sequential: a request sees every earlier one's blocks cached
    and saves landed. A disagreement on a request that started while an
    earlier one was still running is marked ``overlapped``: its lookup may
    have come before those blocks were computed or stored.
    """
    from vllm_kvcodec.tools.bench.trace_model import CostModel, measured_codecs, model_spec
    from vllm_kvcodec.tools.bench.trace_sim import FleetSpec, simulate

    measured = {r["index"]: r for r in result["per_request"]}
    if len(measured) < len(requests) or result["workers_killed"]:
        return {"compared": False, "why": "not every request was scheduled (failed requests or a killed worker)"}
    order = sorted(requests, key=lambda r: (measured[r.index]["t"], r.index))
    fleet = FleetSpec(workers=spec.workers, tokens_per_id=spec.tokens_per_id, block_tokens=spec.block_size,
                      chunk_tokens=spec.chunk_size, local_tokens=result["local_tokens"] or 0, store_bytes=0,
                      connector=result["connector"], near_bytes=0)
    model = model_spec("smollm2-135m")
    if fit:
        model = dataclasses.replace(model, name="smollm2-135m on this machine", s_per_token=fit["s_per_token"],
                                    s_per_token2=fit["s_per_token2"], source=f"fitted to ({fit['fitted_on']})")
    cost = CostModel(model, measured_codecs()[spec.codec], link_gbps=10.0, decode_threads=1,
                     overhead_s=fit["overhead_s"] if fit else 0.0)
    sim = simulate(order, fleet, cost, routing=[measured[r.index]["worker"] for r in order],
                   max_output=spec.max_output, per_request=True, time_scale=1.0 / spec.speed)
    overlapped = _overlapped(result)
    rows = []
    for predicted in sim["per_request"]:
        got = measured[predicted["index"]]
        same = all(predicted[k] == got[k] for k in ("prompt", "local", "store", "computed"))
        rows.append({"index": predicted["index"], "worker": got["worker"], "exact": same,
                     "overlapped": predicted["index"] in overlapped,
                     "measured": {k: got[k] for k in ("prompt", "local", "store", "computed")},
                     "predicted": {k: predicted[k] for k in ("prompt", "local", "store", "computed")}})
    wrong = [r for r in rows if not r["exact"]]
    return {"compared": True, "requests": len(rows), "exact": len(rows) - len(wrong),
            "disagreements_overlapped": sum(r["overlapped"] for r in wrong), "shares": sim["shares"],
            "disagreements": wrong, "ttft": _ttft(sim["per_request"], result.get("ttfts_s") or [], fit)}


def _ttft(predicted: list[dict[str, Any]], measured: list[float], fit: dict[str, Any] | None) -> dict[str, Any]:
    from vllm_kvcodec.tools.bench.trace_fit import ttft_error

    if fit is None or not measured:
        return {"compared": False}
    pairs = [(p["ttft_s"], measured[p["index"]]) for p in predicted if p["index"] < len(measured)]
    return {**ttft_error([a for a, _ in pairs], [b for _, b in pairs]), "fit": fit}


def _overlapped(result: dict[str, Any]) -> set[int]:
    """Requests the client sent while an earlier one was still unanswered (its start and end times, by index)."""
    starts, e2els = result.get("start_times", []), result.get("e2els_s", [])
    if not starts or len(starts) != len(e2els):
        return set()
    ends = [s + e for s, e in zip(starts, e2els)]
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    out, latest = set(), float("-inf")
    for i in order:
        if starts[i] < latest:
            out.add(i)
        latest = max(latest, ends[i])
    return out


# ---- report ----------------------------------------------------------------------------------
def targets(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the scaled replay: (c), (d) compute at most 100 % - ceiling + 5 points of prompt
    tokens, with TTFT p50 below (a)'s and (b)'s; (d) at least matches (c)."""
    by = {c["config"]: c for c in out["configs"]}
    limit = 1 - out["ceiling_share"] + 0.05
    t: dict[str, Any] = {}
    for name in ("c", "d"):
        if name not in by:
            continue
        c = by[name]
        t[f"({name}) computed share <= {limit:.3f}"] = {"value": c["shares_vllm"]["computed"],
                                                        "met": c["shares_vllm"]["computed"] <= limit}
        for base in ("a", "b"):
            if base in by and c["median_ttft_ms"] is not None and by[base]["median_ttft_ms"] is not None:
                t[f"({name}) TTFT p50 < ({base})'s"] = {"value": c["median_ttft_ms"], "of": by[base]["median_ttft_ms"],
                                                       "met": c["median_ttft_ms"] < by[base]["median_ttft_ms"]}
    if "c" in by and "d" in by:
        t["(d) hit share >= (c)'s"] = {"value": 1 - by["d"]["shares_vllm"]["computed"],
                                       "of": 1 - by["c"]["shares_vllm"]["computed"],
                                       "met": by["d"]["shares_vllm"]["computed"] <= by["c"]["shares_vllm"]["computed"]}
    return t


def _log_one(r: dict[str, Any], ceiling: float) -> None:
    s = r["shares_vllm"]
    cmp = r["comparison"]
    exact = f", simulator exact on {cmp['exact']}/{cmp['requests']}" if cmp.get("compared") else ""
    if cmp.get("compared") and cmp["ttft"].get("compared"):
        t = cmp["ttft"]
        exact += (f"; modelled TTFT p50 {t['p50_predicted_s'] * 1000:.0f} ms against {t['p50_measured_s'] * 1000:.0f} "
                  f"(costs fitted to ({t['fit']['fitted_on']}); median error per request "
                  f"{t['median_relative_error']:.0%})")
    console.log(f"({r['config']}) computed {s['computed']:.1%}, local {s['local']:.1%}, store {s['store']:.1%} "
                f"(ceiling {ceiling:.1%}); TTFT p50 {r['median_ttft_ms'] or 0:.0f} ms; {r['failed']} failed{exact}")


def print_replay(out: dict[str, Any]) -> None:
    rows = []
    for r in out["configs"]:
        s, done = r["shares_vllm"], max(1, r["completed"] or 0)
        cmp = r["comparison"]
        rows.append([f"({r['config']})", r["policy"], "yes" if r["connector"] else "no", f"{s['computed']:.1%}",
                     f"{s['local']:.1%}", f"{s['store']:.1%}",
                     f"{(s['local'] + s['store']) / out['ceiling_share']:.0%}" if out["ceiling_share"] else "-",
                     f"{r['median_ttft_ms'] or 0:.0f}", f"{r['p99_ttft_ms'] or 0:.0f}",
                     f"{r['request_throughput'] or 0:.2f}", str(r["failed"]),
                     f"{r['far_bytes_read'] / done / 1e6:.2f}" if r["connector"] else "-",
                     f"{r.get('stored_bytes', 0) / 1e6:.1f}" if r["connector"] else "-",
                     f"{r['stored_ratio']:.3f}" if r.get("stored_ratio") else "-",
                     f"{cmp['exact']}/{cmp['requests']}" if cmp.get("compared") else "-"])
    sp = out["spec"]
    wide_table(f"{out['requests']} requests of {Path(sp['trace']).name}, {sp['tokens_per_id']} tokens per id: "
               f"{out['prompt_tokens']} prompt tokens, ceiling {out['ceiling_share']:.1%}; {sp['workers']} workers, "
               f"speed {sp['speed']:g}x, answers <= {sp['max_output']} tokens",
               ["cfg", "router", "conn", "computed", "local", "store", "hit/ceil", "TTFT p50", "p99 ms", "req/s",
                "failed", "far MB/req", "stored MB", "ratio", "sim exact"], rows, width=160)
    for name, t in out["targets"].items():
        console.print(f"{'met ' if t['met'] else 'MISSED'} {name}: {t['value']:.3f}" +
                      (f" (vs {t['of']:.3f})" if "of" in t else ""))
    console.print(f"[dim]{out['seconds']:.0f} s[/dim]")
