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


@app.command()
def demo(tokens: int = typer.Option(2048, help="Tokens of real KV to compress.")) -> None:
    """Compress real SmolLM2 KV with every codec, verify bit-exactness, print ratio and speed."""
    from vllm_kvcodec.bench import codecs

    result = codecs.run(None, tokens=tokens, repeats=1)
    if not all(r["bit_exact"] for r in result["results"]):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
