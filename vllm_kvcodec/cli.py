"""The ``kvcodec`` command: demo and benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

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
    from vllm_kvcodec.bench import codecs

    codecs.run(output, tokens=tokens, chunk_tokens=chunk_tokens, repeats=repeats)


@bench_app.command("stores")
def bench_stores(
    output: Path = typer.Option(RESULTS / "stores.json", help="JSON file to write."),
    redis_url: Optional[str] = typer.Option(None, help="Redis to measure (default: a temporary local redis-server)."),
) -> None:
    """put/get MB/s of the file and Redis stores for 1, 4 and 16 MiB objects."""
    from vllm_kvcodec.bench import stores

    stores.run(output, redis_url=redis_url)


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
) -> None:
    """TTFT of a 4k-token prefix loaded through the connector per codec at 1/10/100 Gbit/s vs recompute."""
    from vllm_kvcodec.bench import ttft

    ttft.run(output, codecs=codec or None, gbps=gbps or None, rtt_ms=rtt_ms, prefix_tokens=prefix_tokens,
             suffix_tokens=suffix_tokens, repeats=repeats, video=video, quick=quick)


@app.command()
def demo(
    codec: str = typer.Option("rans", help="Codec to save with: raw, zstd, splitzip, rans, video or auto."),
    tokens: int = typer.Option(2048, help="Tokens of real text in the shared prompt prefix."),
    store: Optional[str] = typer.Option(None, help="Store URL (default: a fresh temporary file store, removed afterwards)."),
) -> None:
    """Two vLLM engines share a long prompt's prefix through the store: TTFT cold vs warm, bytes, exact tokens."""
    from vllm_kvcodec import demo as demo_mod

    result = demo_mod.run(codec=codec, tokens=tokens, store=store)
    if not result["ok"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
