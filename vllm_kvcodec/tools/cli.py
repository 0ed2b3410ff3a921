"""The ``kvcodec`` command: serve, demo, config, store tools and benchmarks."""

from __future__ import annotations

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
    output: Path = typer.Option(RESULTS / "ttft.json", help="JSON file to write."),
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
) -> None:
    """TTFT of a 4k-token prefix loaded through the connector per codec at 1/10/100 Gbit/s vs recompute."""
    from vllm_kvcodec.tools.bench import ttft

    ttft.run(output, codecs=codec or None, gbps=gbps or None, rtt_ms=rtt_ms, prefix_tokens=prefix_tokens,
             suffix_tokens=suffix_tokens, repeats=repeats, video=video, quick=quick, store=store,
             replay=replay, replay_only=replay_only, replay_repeats=replay_repeats, load_wait=load_wait)


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
    """One line on stderr and exit status 2 (a usage error): the same for every command and every bad argument."""
    typer.echo("error: " + " ".join(part.strip() for part in str(message).splitlines() if part.strip()), err=True)
    raise typer.Exit(2)


@app.command()
def inspect(store: str = typer.Argument(..., help="Store URL, e.g. redis://host:6379/0 or file:///path.")) -> None:
    """Namespaces, chunk and object counts, bytes stored vs raw, average ratio and codecs in a store (read-only)."""
    from rich.progress import Progress

    from storage import StoreError, open_store
    from vllm_kvcodec.tools.bench.report import console, table
    from vllm_kvcodec.tools.store_tools import inspect_store

    try:
        with open_store(store, read_only=True) as s, Progress(console=console, transient=True) as bar:
            task = bar.add_task("reading chunk headers", total=None)
            summary = inspect_store(s, lambda: bar.advance(task))
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
    """Re-check every stored chunk (checksum, header, codec payload); exit 1 if any is damaged. Read-only unless --delete."""
    from rich.progress import Progress

    from storage import StoreError, open_store
    from vllm_kvcodec.tools.bench.report import console
    from vllm_kvcodec.tools.store_tools import delete_objects, verify_store

    try:
        with open_store(store, read_only=True) as s, Progress(console=console, transient=True) as bar:
            task = bar.add_task("verifying chunks", total=None)
            damaged = verify_store(s, progress=lambda: bar.advance(task))
        if delete and damaged:
            with open_store(store) as s:  # it exists (it was just read), so opening it for writes creates nothing
                delete_objects(s, [key for key, _ in damaged])
    except (StoreError, ValueError) as exc:
        fail(exc)
    for key, reason in damaged:
        console.print(f"damaged{' (deleted)' if delete else ''}: {key}: {reason}")
    console.print(f"{len(damaged)} damaged object(s)")
    if damaged:
        raise typer.Exit(1)


@app.command()
def config(
    store: Optional[str] = typer.Option(None, help="Store URL (default: the embedded file store)."),
    codec: Optional[str] = typer.Option(None, help="Codec id or 'auto' (default: the densest for the model's dtype)."),
    chunk_size: int = typer.Option(256, help="Tokens per chunk; a multiple of vLLM's --block-size (a multiple of 32 on the CPU backend, of 16 on CUDA)."),
    load_mode: str = typer.Option("sync", help="sync or async."),
) -> None:
    """Print a validated --kv-transfer-config JSON for `vllm serve`."""
    import json

    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.tools.block_sizes import chunk_size_note
    from vllm_kvcodec.tools.serve import kv_transfer_config

    extra = {"chunk_size": chunk_size, "load_mode": load_mode}
    extra.update({k: v for k, v in {"store": store, "codec": codec}.items() if v is not None})
    try:
        transfer = kv_transfer_config(extra)
    except ConfigError as exc:
        fail(exc)
    if note := chunk_size_note(chunk_size):
        typer.echo(note, err=True)
    typer.echo(json.dumps(transfer))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Every other argument goes to `vllm serve` unchanged (see `vllm serve --help`); "
           "--shutdown-timeout is set unless given (see docs/operations.md).",
)
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Model to serve (a local folder or a hub name), as for `vllm serve`."),
    store: Optional[str] = typer.Option(None, help="Store URL (default: the embedded file store)."),
    codec: Optional[str] = typer.Option(None, help="Codec id or 'auto' (default: the densest for the model's dtype)."),
    connector_config: Optional[str] = typer.Option(
        None, "--connector-config", help='More kv_connector_extra_config keys, as a JSON object: \'{"chunk_size": 512}\'.'),
) -> None:
    """vLLM's OpenAI-compatible server with the connector: `kvcodec serve MODEL --store URL [vllm serve arguments]`."""
    import json
    import os

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
        plan = plan_serve(model, {**extra, **more}, ctx.args, os.environ)
    except ConfigError as exc:
        fail(exc)
    for note in plan.notes:
        typer.echo(note, err=True)
    os.environ.update(plan.env)  # vLLM's processes inherit it
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
