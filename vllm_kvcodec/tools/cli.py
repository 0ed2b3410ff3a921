"""The ``kvcodec`` command: serve, demo, config, store tools and benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, Optional

import typer

app = typer.Typer(help="Lossless compressed remote prefix KV cache for vLLM.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks: print a table and write JSON.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

RESULTS = Path("bench-results")


@bench_app.command("codecs")
def bench_codecs(
    output: Path = typer.Option(RESULTS / "codecs.json", help="JSON file to write."),
    tokens: int = typer.Option(4096, help="Tokens of real KV to split into chunks."),
    chunk_tokens: int = typer.Option(256, help="Tokens per chunk."),
    repeats: int = typer.Option(3, help="Timed passes per codec (best is reported)."),
) -> None:
    """Ratio and single-core encode/decode MB/s of every codec on real SmolLM2 KV."""
    from vllm_kvcodec.tools.bench import codecs

    codecs.run(output, tokens=tokens, chunk_tokens=chunk_tokens, repeats=repeats)


@bench_app.command("layouts")
def bench_layouts(
    precision: Optional[list[str]] = typer.Option(None, "--precision", help="Lossy level(s) whose integers to code (repeatable; default int8)."),
    tokens: int = typer.Option(1024, min=1, help="Tokens of real KV, cut into 256-token chunks."),
    repeats: int = typer.Option(3, min=1, help="Timed passes per candidate (the median is reported)."),
    candidate: Optional[list[str]] = typer.Option(None, "--candidate", help="Only these candidates (repeatable; default all)."),
    json_out: Path = typer.Option(RESULTS / "layouts.json", "--json", help="JSON file to write."),
) -> None:
    """KVCodec's layout claim: a lossy level's integers coded by rANS, HEVC (KVCodec's layout and a naive one) and FFV1."""
    from vllm_kvcodec.codecs.precision import LEVELS

    levels = tuple(precision or ("int8",))
    if bad := [p for p in levels if p not in LEVELS]:
        fail(ValueError(f"precision {bad[0]!r} is not a lossy level ({', '.join(LEVELS)})"))
    from vllm_kvcodec.tools.bench import layouts

    names = tuple(candidate) if candidate else None
    try:
        layouts.pick(names)
    except ValueError as exc:
        fail(exc)
    layouts.run(json_out, precisions=levels, tokens=tokens, repeats=repeats, names=names)


@bench_app.command("stores")
def bench_stores(
    output: Path = typer.Option(RESULTS / "stores.json", help="JSON file to write."),
    redis_url: Optional[str] = typer.Option(None, help="Redis to measure (default: a temporary local redis-server)."),
    mooncake_url: Optional[str] = typer.Option(
        None, help="Mooncake pool to measure (default: a temporary local master and two nodes)."
    ),
    threads: Optional[list[int]] = typer.Option(None, "--threads", help="Thread count(s) (repeatable; default 1, 4)."),
) -> None:
    """put/get MB/s of the file, Redis and Mooncake stores for 1, 4 and 16 MiB objects, 1 and 4 threads."""
    from vllm_kvcodec.tools.bench import stores

    stores.run(output, redis_url=redis_url, mooncake_url=mooncake_url, threads=tuple(threads or stores.THREADS))


@bench_app.command("serve")
def bench_serve(
    output: Path = typer.Option(RESULTS / "serve.json", help="JSON file to write."),
    repeats: int = typer.Option(2, min=1, help="Interleaved repeats of the three servers (none, save, load)."),
    codec: str = typer.Option("rans", help="Codec the saving server uses."),
    store: Optional[str] = typer.Option(None, help="Store URL (default: a temporary file store; a fresh key prefix per repeat)."),
    num_prompts: int = typer.Option(48, min=1, help="Requests per run."),
    prefix_len: int = typer.Option(1500, min=1, help="Tokens of each shared prefix."),
    suffix_len: int = typer.Option(64, min=1, help="Tokens of each request's own suffix."),
    num_prefixes: int = typer.Option(4, min=1, help="Distinct shared prefixes."),
    output_len: int = typer.Option(8, min=1, help="Tokens generated per request."),
    request_rate: str = typer.Option("inf", help="Requests per second ('inf': all at once, saturation)."),
    save_thread_nice: int = typer.Option(0, min=0, max=19, help="The saving servers' save_thread_nice."),
    codec_when_behind: str = typer.Option("splitzip", help="The saving servers' save_codec_when_behind ('none': off)."),
    upgrade: bool = typer.Option(True, help="upgrade_fallback_chunks: loading servers re-encode fallback-coded objects they load."),
    link: Optional[str] = typer.Option(None, help="Put the temporary file store behind the link emulator, e.g. 'gbps=10&rtt_ms=10'."),
    lookup: Optional[list[str]] = typer.Option(None, "--lookup", help="Compare loading servers per lookup mode (repeatable: auto, sync, async); no server without the connector then, unless --baseline."),
    prefetch: Optional[list[int]] = typer.Option(None, "--prefetch", min=0, help="Compare loading servers per prefetch_bytes (repeatable, e.g. 0 and 268435456; with --lookup: every pair); no server without the connector then, unless --baseline."),
    baseline: Optional[bool] = typer.Option(None, "--baseline/--no-baseline", help="Run a server without the connector in each repeat (default: only without --lookup and --prefetch)."),
    save_lookup: Optional[list[str]] = typer.Option(None, "--save-lookup", help="Add a saving server per lookup mode (repeatable: sync, async, auto), each into an empty store of its own, next to the default one."),
) -> None:
    """vLLM's own client (vllm bench serve, prefix_repetition) against vllm serve without the connector, saving, and loading."""
    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.tools.serve import checked_config

    try:  # before any server starts
        behind = None if codec_when_behind == "none" else codec_when_behind
        checked_config({"codec": codec, "save_codec_when_behind": behind, **({"store": store} if store else {})})
    except ConfigError as exc:
        fail(exc)
    from vllm_kvcodec.tools.bench import serve

    serve.run(output, repeats=repeats, codec=codec, store=store, num_prompts=num_prompts, prefix_len=prefix_len,
              suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=output_len, request_rate=request_rate,
              save_thread_nice=save_thread_nice, codec_when_behind=behind, upgrade=upgrade, link=link,
              lookups=tuple(lookup or ()), prefetches=tuple(prefetch or ()), baseline=baseline,
              save_lookups=tuple(save_lookup or ()))


@bench_app.command("trace")
def bench_trace(
    simulate: Optional[Path] = typer.Option(None, "--simulate", help="Simulate this trace file (the whole of it by default) instead of replaying one on real servers."),
    trace: Optional[Path] = typer.Option(None, help="Replay: the trace file (default ../shared/data/traces/mooncake_conversation_trace.jsonl beside the checkout)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="JSON file to write (default bench-results/trace.json, trace-sim.json or trace-curves.json)."),
    workers: Optional[int] = typer.Option(None, min=1, help="Workers (default: 2 replayed, 16 simulated)."),
    first: Optional[int] = typer.Option(None, min=1, help="Only the first N requests (replay default: 40)."),
    start_s: float = typer.Option(0.0, min=0, help="Skip requests arriving before this many seconds of the trace."),
    window_s: Optional[float] = typer.Option(None, min=0, help="Only requests arriving within this many seconds (after --start-s)."),
    tokens_per_id: Optional[int] = typer.Option(None, min=1, help="Prompt tokens per trace id (default: 32 replayed, 512 simulated: the real trace)."),
    max_output: Optional[int] = typer.Option(None, min=1, help="Cap each answer at this many tokens (replay default: 4)."),
    block_tokens: Optional[int] = typer.Option(None, min=1, help="vLLM's block size in tokens (default: 32 replayed, a CPU engine's smallest; 16 simulated, a GPU's)."),
    chunk_tokens: int = typer.Option(256, min=1, help="The connector's chunk_size."),
    codec: str = typer.Option("rans", help="The connector's codec (simulated: its measured ratio and decode speed)."),
    local_tokens: int = typer.Option(1_000_000, min=0, help="Simulated: each worker's local prefix cache in tokens (0: none)."),
    store_bytes: str = typer.Option("0", help="Simulated: the shared store's size (e.g. 2T, 500GiB; 0: unbounded)."),
    near_bytes: str = typer.Option("0", help="Near tier per worker: simulated size (0: none); replayed (e) default 2GiB."),
    connector: bool = typer.Option(True, help="Simulated: the connector on (a shared store) or off (local caches only)."),
    policy: str = typer.Option("round_robin", help="Simulated routing: round_robin or longest_prefix."),
    balance_s: float = typer.Option(1.0, min=0, help="Simulated longest_prefix: only workers whose queue is within this many seconds of the shortest."),
    model: str = typer.Option("llama-70b", help="Simulated replica: llama-70b (8 x H100), llama-8b (1 x H100), smollm2-135m."),
    kv_bytes_per_token: Optional[int] = typer.Option(None, min=1, help="Override the model's KV bytes per token."),
    prefill_s_per_token: Optional[float] = typer.Option(None, min=0, help="Override the prefill seconds per token."),
    prefill_s_per_token2: Optional[float] = typer.Option(None, min=0, help="Override the prefill seconds per token squared (attention)."),
    link_gbps: float = typer.Option(100.0, min=0.001, help="Simulated link to the shared store, Gbit/s."),
    decode_threads: int = typer.Option(16, min=1, help="Simulated decode threads per replica (times the codec's measured one-thread speed)."),
    overlap: bool = typer.Option(True, help="Simulated: a load overlaps the prefill of the rest (layer streaming)."),
    time_scale: float = typer.Option(1.0, min=0, help="Simulated: multiply the trace's arrival times (queueing)."),
    per_request: bool = typer.Option(False, help="Simulated: write each request's split to the JSON."),
    curves: bool = typer.Option(False, help="Simulated: sweep the store size for raw, splitzip, rans and video, both policies, llama-70b and llama-8b."),
    configs: str = typer.Option("abcde", help="Replay: configurations, any of a b c d e."),
    speed: float = typer.Option(1.0, min=0.001, help="Replay: trace seconds per replay second."),
    min_gap_s: float = typer.Option(0.0, min=0, help="Replay: space arrivals at least this far apart (seconds)."),
    link: Optional[str] = typer.Option(None, help="Replay: put Redis behind the link emulator, e.g. 'gbps=10&rtt_ms=0.5'."),
    kv_cache_gib: int = typer.Option(1, min=1, help="Replay: each worker's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)."),
    hash_seed: int = typer.Option(0, help="Replay: PYTHONHASHSEED of the client (its prompts) and the workers."),
    work_dir: Optional[Path] = typer.Option(None, help="Replay: keep every log and ledger in this folder."),
) -> None:
    """A production trace: replayed through vllm-router and vllm bench serve on a fleet (a)-(e), or simulated whole."""
    from vllm_kvcodec.tools.bench.trace_file import DEFAULT_TRACE, TRACE_TOKENS_PER_ID, TraceError

    try:
        if simulate is not None:
            _simulate_trace(simulate, json_out, workers or 16, first, start_s, window_s,
                            tokens_per_id or TRACE_TOKENS_PER_ID, max_output, block_tokens or 16, chunk_tokens, codec,
                            local_tokens, store_bytes, near_bytes, connector, policy, balance_s, model,
                            kv_bytes_per_token, prefill_s_per_token, prefill_s_per_token2, link_gbps, decode_threads,
                            overlap, time_scale, per_request, curves)
            return
        from vllm_kvcodec.tools.bench import trace as replay

        spec = replay.ReplaySpec(
            trace=trace or DEFAULT_TRACE, first=first if first or window_s else 40, start_s=start_s,
            window_s=window_s, tokens_per_id=tokens_per_id or 32, speed=speed, max_output=max_output or 4,
            workers=workers or 2, block_size=block_tokens or 32, chunk_size=chunk_tokens, codec=codec, link=link,
            near_bytes=near_bytes if near_bytes != "0" else "2GiB", kv_cache_gib=kv_cache_gib, configs=configs,
            hash_seed=hash_seed, min_gap_s=min_gap_s, work_dir=work_dir)
        replay.check_parts(spec)
    except (TraceError, ValueError, RuntimeError) as exc:
        fail(exc)
    result = replay.run(spec, json_out or RESULTS / "trace.json")
    if any(c["failed"] for c in result["configs"]):
        raise typer.Exit(1)


def _simulate_trace(path: Path, json_out: Optional[Path], workers: int, first: Optional[int], start_s: float,
                    window_s: Optional[float], tokens_per_id: int, max_output: Optional[int], block_tokens: int,
                    chunk_tokens: int, codec: str, local_tokens: int, store_bytes: str, near_bytes: str,
                    connector: bool, policy: str, balance_s: float, model: str, kv_bytes_per_token: Optional[int],
                    s_per_token: Optional[float], s_per_token2: Optional[float], link_gbps: float,
                    decode_threads: int, overlap: bool, time_scale: float, per_request: bool, curves: bool) -> None:
    from vllm_kvcodec.tools.bench import trace_study
    from vllm_kvcodec.tools.bench.trace_file import read_trace, select
    from vllm_kvcodec.tools.bench.trace_model import CostModel, measured_codecs, model_spec
    from vllm_kvcodec.tools.bench.trace_sim import FleetSpec

    requests = select(read_trace(path), path, start_s, window_s, first or None)
    if curves:
        trace_study.curves(requests, json_out or RESULTS / "trace-curves.json", workers=workers)
        return
    codecs = measured_codecs()
    if codec not in codecs:
        raise ValueError(f"unknown codec {codec!r} for the simulator; measured: {', '.join(codecs)}")
    fleet = FleetSpec(workers=workers, tokens_per_id=tokens_per_id, block_tokens=block_tokens,
                      chunk_tokens=chunk_tokens, local_tokens=local_tokens, store_bytes=_size(store_bytes),
                      connector=connector, near_bytes=_size(near_bytes), policy=policy, balance_s=balance_s)
    cost = CostModel(model_spec(model, kv_bytes_per_token, s_per_token, s_per_token2), codecs[codec],
                     link_gbps=link_gbps, decode_threads=decode_threads, overlap=overlap)
    trace_study.run_one(requests, fleet, cost, json_out or RESULTS / "trace-sim.json", max_output=max_output,
                        per_request=per_request, time_scale=time_scale)


def _size(text: str) -> int:
    """Bytes from a size such as 2T or 500GiB; 0 stays 0 (unbounded, or none)."""
    from storage.options import parse_size

    return 0 if text.strip() in ("0", "") else parse_size("size", text)


@bench_app.command("schedule")
def bench_schedule(
    output: Path = typer.Option(RESULTS / "schedule.json", help="JSON file to write."),
    rtt_ms: Optional[list[float]] = typer.Option(None, "--rtt-ms", help="Store round trip(s) in ms (repeatable; default 0, 1, 10)."),
    arrivals: int = typer.Option(32, min=1, help="New requests arriving in one step."),
    prompt_tokens: int = typer.Option(1100, min=2, help="Tokens per arriving prompt (their full chunks are stored)."),
    step_ms: float = typer.Option(20.0, min=0, help="How long each step's emulated forward pass takes."),
    repeats: int = typer.Option(3, min=1, help="Interleaved runs of each lookup mode per RTT."),
    lookup: Optional[list[str]] = typer.Option(None, "--lookup", help="Lookup modes to compare (repeatable; default sync, async, auto)."),
) -> None:
    """Time vLLM's scheduler spends per step while requests arrive, with lookups inline (sync), on the lookup thread (async), and as auto chooses."""
    from vllm_kvcodec.tools.bench import schedule

    schedule.run(output, rtts_ms=tuple(rtt_ms or (0.0, 1.0, 10.0)), arrivals=arrivals, prompt_tokens=prompt_tokens,
                 step_ms=step_ms, repeats=repeats, modes=tuple(lookup or ("sync", "async", "auto")))


@bench_app.command("ttft")
def bench_ttft(
    output: Path = typer.Option(RESULTS / "ttft.json", "--output", "--json", help="JSON file to write."),
    codec: Optional[list[str]] = typer.Option(None, "--codec", help="Codec(s) to measure (repeatable; default raw, zstd, splitzip, rans, auto)."),
    gbps: Optional[list[float]] = typer.Option(None, "--gbps", help="Link speed(s) in Gbit/s (repeatable; default 1, 10, 100)."),
    rtt_ms: float = typer.Option(0.2, help="Round-trip time of the emulated link."),
    prefix_tokens: int = typer.Option(4096, help="Tokens of the stored shared prefix."),
    suffix_tokens: int = typer.Option(64, help="Tokens of the new suffix computed after the load."),
    repeats: int = typer.Option(3, help="Timed requests per codec and link (the median is reported)."),
    video: bool = typer.Option(False, "--video", help="Also measure the video codec (slow to encode)."),
    quick: bool = typer.Option(False, "--quick", help="raw, rans and auto only, 2 repeats."),
    store: Optional[str] = typer.Option(
        None, help="Store URL behind the link (e.g. mooncake://host:port?...; default: a temporary file store)."
    ),
    replay: bool = typer.Option(True, help="Also replay the whole prompt from local disk beside vLLM's ExampleConnector."),
    replay_only: bool = typer.Option(False, "--replay-only", help="Only the replay beside ExampleConnector (no links, no recompute baseline): minutes instead of an hour."),
    replay_repeats: int = typer.Option(10, help="Timed (replay, local hit) pairs per replay row (the median of their ratios is reported)."),
    load_wait: str = typer.Option("auto", help="The connector's load_wait (auto, layers, whole): whether the prefill waits for the whole load."),
    precision: Optional[list[str]] = typer.Option(
        None, "--precision", help="Precision rows, e.g. lossless,int8,int6,int4 (repeatable): raw reuse and lossless "
                                  "rans beside each lossy level (LOSSY: NOT BIT-EXACT), on paper-scaled links unless --gbps."),
    paper_scale: Optional[bool] = typer.Option(
        None, "--paper-scale/--no-paper-scale", help="Scale the paper's links to this host's prefill speed (default: "
                                                     "with --precision and no --gbps)."),
    paper_gbps: Optional[list[float]] = typer.Option(None, "--paper-gbps", help="The paper's links to scale (repeatable; default 1, 4, 16, 40)."),
    paper_prefill_tok_s: Optional[float] = typer.Option(
        None, min=1e-9, help="The paper's prefill tokens/s (default: estimated from FLOPs, Yi-34B on an H20 at 50% MFU)."),
) -> None:
    """TTFT of a 4k-token prefix loaded through the connector per codec at 1/10/100 Gbit/s vs recompute."""
    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.tools.bench import ttft

    try:  # before any engine starts
        ttft.precision_settings(precision, paper_scale, gbps, replay_only)
    except ConfigError as exc:  # an unknown precision, or paper-scaled links without the recompute baseline
        fail(exc)
    ttft.run(output, codecs=codec or None, gbps=gbps or None, rtt_ms=rtt_ms, prefix_tokens=prefix_tokens,
             suffix_tokens=suffix_tokens, repeats=repeats, video=video, quick=quick, store=store,
             replay=replay, replay_only=replay_only, replay_repeats=replay_repeats, load_wait=load_wait,
             precisions=precision or None, paper_scale=paper_scale, paper_gbps=paper_gbps or None,
             paper_prefill_tok_s=paper_prefill_tok_s)


@bench_app.command("quality")
def bench_quality(
    output: Path = typer.Option(RESULTS / "quality.json", "--json", help="JSON file to write."),
    precision: Optional[list[str]] = typer.Option(
        None, "--precision", help="Lossy level(s) to measure, e.g. int8 or 'int4,sink_tokens=4,full_layers=2' "
                                  "(repeatable; default int8). The lossless control always runs."),
    text: Optional[Path] = typer.Option(None, "--text", exists=True, dir_okay=False,
                                        help="A local UTF-8 text (default: CPython's pydoc_data.topics)."),
    prefix_tokens: Optional[list[int]] = typer.Option(None, "--prefix-tokens", help="Prefix length(s), whole 256-token chunks (repeatable; default 512, 1024, 2048)."),
    continuation_tokens: int = typer.Option(128, help="Tokens scored teacher-forced after each prefix."),
    greedy_tokens: int = typer.Option(64, help="Greedy tokens within which a divergence is looked for."),
    windows: int = typer.Option(8, help="Disjoint windows of the text, each scored at every prefix length."),
    threads: int = typer.Option(1, min=1, help="Torch threads (the engines' too)."),
    engine: bool = typer.Option(False, "--engine", help="Also compare greedy tokens through real vLLM engines with "
                                                        "the connector, each level's load against the lossless load."),
    engine_only: bool = typer.Option(False, "--engine-only", help="Only the engine comparison: it is set as the "
                                                                  "--json file's engine block, its other figures kept."),
    engine_prompts: int = typer.Option(16, help="Engine comparison: prompts, disjoint windows of the text."),
    engine_prefix_tokens: int = typer.Option(1024, help="Engine comparison: prefix tokens each prompt loads (whole 256-token chunks)."),
    engine_greedy_tokens: int = typer.Option(32, help="Engine comparison: greedy tokens decoded after each prompt."),
) -> None:
    """LOSSY: NOT BIT-EXACT. ΔNLL, KL and top-1 agreement of SmolLM2 scoring a text on KV stored at a precision level;
    with --engine, greedy tokens through vLLM after a lossy load against a lossless one."""
    from vllm_kvcodec.tools.bench import quality
    from vllm_kvcodec.tools.bench.quality_engine import EngineSpec

    spec = EngineSpec(engine_prompts, engine_prefix_tokens, engine_greedy_tokens) if engine or engine_only else None
    try:
        quality.run(output, levels=precision or None, text=text, prefix_tokens=tuple(prefix_tokens or (512, 1024, 2048)),
                    continuation_tokens=continuation_tokens, greedy_tokens=greedy_tokens, windows=windows,
                    threads=threads, engine=spec, teacher_forced=not engine_only)
    except ValueError as exc:  # ConfigError among them: a bad level, prefix, or a text too short
        fail(exc)


@bench_app.command("fuzz")
def bench_fuzz(
    output: Path = typer.Option(RESULTS / "fuzz.json", help="JSON file to write."),
    inputs: int = typer.Option(100_000, help="Hostile inputs in all, shared among the targets."),
    seed: int = typer.Option(0, help="Seed; input i of a target is rebuilt from (seed, target, i)."),
    timeout_s: float = typer.Option(30.0, help="Watchdog: one input running longer than this is a hang."),
    video: bool = typer.Option(True, "--video/--no-video", help="Include the video codec's decoders (PyAV)."),
    target: Optional[list[str]] = typer.Option(None, "--target", help="Only these targets (repeatable)."),
) -> None:
    """Fuzz decode_chunk and every codec decoder: outcomes, allocation, time, crashes and hangs."""
    from vllm_kvcodec.tools.bench import fuzz

    result = fuzz.run(output, inputs=inputs, seed=seed, timeout_s=timeout_s, video=video, targets=target or None)
    if not result["clean"]:
        raise typer.Exit(1)


@bench_app.command("memory")
def bench_memory(
    output: Path = typer.Option(RESULTS / "memory.json", help="JSON file to write."),
    tokens: int = typer.Option(32768, help="Prefix length (a multiple of 4096)."),
    codec: Optional[list[str]] = typer.Option(None, "--codec", help="Codec(s) to measure (repeatable; default rans, raw)."),
    fetch_threads: int = typer.Option(4, help="Fetcher threads (the connector's default)."),
    save_threads: int = typer.Option(2, help="Saver threads (the connector's default)."),
    max_pending_save_bytes: int = typer.Option(512 << 20, help="Saver queue cap in raw bytes (the connector's default)."),
    step_tokens: int = typer.Option(8192, help="Tokens prefilled per engine step (vLLM's max_num_batched_tokens)."),
    load: bool = typer.Option(True, "--load/--save-only", help="Also measure loading the saved prefix."),
) -> None:
    """Peak RSS of saving and loading a 32k-token prefix through the real Saver and Fetcher, each in a fresh process."""
    from vllm_kvcodec.tools.bench import memory

    memory.run(output, tokens=tokens, codecs=codec or None, fetch_threads=fetch_threads,
               save_threads=save_threads, max_pending_save_bytes=max_pending_save_bytes, step_tokens=step_tokens, load=load)


@bench_app.command("faults")
def bench_faults(
    output: Path = typer.Option(RESULTS / "faults.json", help="JSON file to write."),
    faulty_loads: int = typer.Option(1000, help="Keep loading until this many loads met at least one fault."),
    seed: int = typer.Option(1, help="Seed of the fault injection and of the load order."),
    drop: Optional[float] = typer.Option(None, help="Probability an object read comes back missing (default 0.02)."),
    truncate: Optional[float] = typer.Option(None, help="Probability an object read comes back truncated (default 0.02)."),
    corrupt: Optional[float] = typer.Option(None, help="Probability an object read comes back with 1-3 flipped bits (default 0.03)."),
    delay: Optional[float] = typer.Option(None, help="Probability an object read is delayed past the load timeout (default 0.005)."),
    swap: Optional[float] = typer.Option(None, help="Probability an object read returns another key's object (default 0.03)."),
    timeout_s: float = typer.Option(0.25, help="Load timeout (the connector's load_timeout_s)."),
    delay_s: float = typer.Option(0.4, help="Delay of a delayed read."),
) -> None:
    """Loads through the connector's fetch path behind a faulty store: exact, failed, and wrong (must be 0)."""
    from vllm_kvcodec.tools.bench import faults

    given = {"drop": drop, "truncate": truncate, "corrupt": corrupt, "delay": delay, "swap": swap}
    rates = {k: v for k, v in given.items() if v is not None}
    result = faults.run(output, faulty_loads=faulty_loads, seed=seed, rates=rates, timeout_s=timeout_s, delay_s=delay_s)
    if result["wrong"]:
        raise typer.Exit(1)


def fail(message: object) -> NoReturn:
    """``error: <message>`` on stderr and exit status 2 (a usage error), the same for every command and every bad
    argument: one line, or where several settings are wrong, a heading and one line per problem."""
    lines = [line.rstrip() for line in str(message).splitlines() if line.strip()]
    typer.echo("\n".join(["error: " + lines[0].strip(), *lines[1:]]), err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def _progress(what: str) -> Iterator[Callable[[], None]]:
    """A transient spinner counting ``what`` through a long read, on a terminal only (piped: the results alone)."""
    from rich.progress import Progress

    from vllm_kvcodec.tools.bench.report import console

    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(what, total=None)
        yield lambda: bar.advance(task)


@app.command()
def layout(root: Optional[Path] = typer.Argument(None, help="A checkout (the folder holding vllm_kvcodec/ and "
                                                                "storage/); default: where this package is installed.")) -> None:
    """The package's rooms in layers, its largest files and any import circle (exit 1 if there is one)."""
    from vllm_kvcodec.tools.layout import read_layout, report

    found = read_layout(root if root is not None else Path(__file__).resolve().parents[2])
    typer.echo(report(found))
    if found.module_circles() or found.room_circles():
        raise typer.Exit(1)


@app.command()
def inspect(store: str = typer.Argument(..., help="Store URL, e.g. redis://host:6379/0 or file:///path.")) -> None:
    """Namespaces, chunk and object counts, bytes stored vs raw, average ratio and codecs in a store (read-only)."""
    from storage import StoreError, open_store
    from vllm_kvcodec.tools.bench.report import table
    from vllm_kvcodec.tools.store_tools import inspect_store

    try:
        with open_store(store, read_only=True) as s, _progress("reading chunk headers") as tick:
            summary = inspect_store(s, tick)
    except (StoreError, ValueError) as exc:
        fail(exc)
    table(f"{s.url}", ["what", "value"], [
        ["objects", summary.objects], ["chunks", len(summary.chunks)], ["namespaces", len(summary.namespaces)],
        ["stored bytes", summary.stored_bytes], ["raw bytes", summary.raw_bytes],
        ["average ratio", f"{summary.ratio:.3f}"], ["damaged", summary.damaged],
        ["block refs", f"{summary.refs} ({summary.ref_bytes} bytes)"],
        ["codecs", ", ".join(f"{c}: {n}" for c, n in summary.codecs.most_common()) or "-"],
    ])
    if summary.damaged:
        raise typer.Exit(1)


@app.command()
def verify(
    store: str = typer.Argument(..., help="Store URL."),
    delete: bool = typer.Option(False, "--delete", help="Delete damaged objects (vLLM recomputes them on the next miss)."),
) -> None:
    """Re-check every stored chunk (checksum, header, codec payload) and say what was checked; exit 1 if any is
    damaged. Read-only unless --delete."""
    from storage import StoreError, open_store
    from vllm_kvcodec.tools.store_tools import delete_objects, verify_report, verify_store

    try:
        with open_store(store, read_only=True) as s, _progress("verifying chunks") as tick:
            summary = verify_store(s, progress=tick)
        if delete and summary.damaged:
            with open_store(store) as s:  # it exists (it was just read), so opening it for writes creates nothing
                delete_objects(s, [key for key, _ in summary.damaged_objects])
    except (StoreError, ValueError) as exc:
        fail(exc)
    for key, reason in summary.damaged_objects:
        typer.echo(f"damaged{' (deleted)' if delete else ''}: {key}: {reason}")
    for line in verify_report(summary):
        typer.echo(line)
    if summary.damaged:
        raise typer.Exit(1)


@app.command()
def config(
    store: Optional[str] = typer.Option(None, help="Store URL (default: the embedded file store)."),
    codec: Optional[str] = typer.Option(None, help="Codec id or 'auto' (default: the densest for the model's dtype)."),
    chunk_size: int = typer.Option(256, help="Tokens per chunk; a multiple of vLLM's --block-size (a multiple of 32 on the CPU backend, of 16 on CUDA)."),
    load_mode: str = typer.Option("sync", help="sync or async."),
    block_size: Optional[int] = typer.Option(None, min=1, help="The --block-size `vllm serve` will be given: chunk_size is checked against it (default: against every block size vLLM's backends take)."),
) -> None:
    """Print a validated --kv-transfer-config JSON for `vllm serve`."""
    import json

    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.tools.block_sizes import chunk_size_note
    from vllm_kvcodec.tools.serve import kv_transfer_config

    extra = {"chunk_size": chunk_size, "load_mode": load_mode}
    extra.update({k: v for k, v in {"store": store, "codec": codec}.items() if v is not None})
    try:
        transfer = kv_transfer_config(extra, block_size)
    except ConfigError as exc:
        fail(exc)
    if block_size is None and (note := chunk_size_note(chunk_size)):
        typer.echo(note, err=True)
    typer.echo(json.dumps(transfer))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Every other argument goes to `vllm serve` unchanged (see `vllm serve --help`); "
           "--shutdown-timeout is set unless given (see docs/operations.md).",
)
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., metavar="MODEL",
                                help="Model to serve (a local folder or a hub name), as for `vllm serve`."),
    store: Optional[str] = typer.Option(None, help="Store URL (default: the embedded file store)."),
    codec: Optional[str] = typer.Option(None, help="Codec id or 'auto' (default: the densest for the model's dtype)."),
    connector_config: Optional[str] = typer.Option(
        None, "--connector-config", help='More kv_connector_extra_config keys, as a JSON object: \'{"chunk_size": 512}\'.'),
) -> None:
    # The help text is rich markup: a bare "[any ...]" would be read as a tag and dropped.
    """vLLM's OpenAI-compatible server with the connector: `kvcodec serve MODEL --store URL \\[any vllm serve
    arguments]`."""
    import json

    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.tools import vllm_cli
    from vllm_kvcodec.tools.serve import plan_serve

    extra = {k: v for k, v in {"store": store, "codec": codec}.items() if v is not None}
    try:
        more = json.loads(connector_config) if connector_config else {}
    except json.JSONDecodeError as exc:
        fail(f"--connector-config is not JSON: {exc}")
    if not isinstance(more, dict):
        fail("--connector-config must be a JSON object of kv_connector_extra_config keys")
    try:
        plan = plan_serve(model, {**extra, **more}, ctx.args)
    except ConfigError as exc:
        fail(exc)
    for note in plan.notes:
        typer.echo(note, err=True)
    vllm_cli.run(plan.argv)


@app.command()
def demo(
    codec: str = typer.Option("rans", help="Codec to save with: raw, zstd, splitzip, rans, video or auto."),
    tokens: int = typer.Option(2048, help="Tokens of real text in the shared prompt prefix."),
    store: Optional[str] = typer.Option(None, help="Store URL (default: a fresh temporary file store, removed afterwards)."),
) -> None:
    """Two vLLM engines share a long prompt's prefix through the store: TTFT cold vs warm, bytes, exact tokens."""
    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.tools import demo as demo_mod

    try:
        demo_mod.check_args(codec=codec, tokens=tokens, store=store)  # before any engine: seconds, not minutes
    except ConfigError as exc:
        fail(exc)
    result = demo_mod.run(codec=codec, tokens=tokens, store=store)
    if not result["ok"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
