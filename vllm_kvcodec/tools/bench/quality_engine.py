"""Greedy tokens through real vLLM engines with the connector, lossy against lossless: LOSSY: NOT BIT-EXACT.

``kvcodec bench quality --engine`` (the ``engine`` block of the quality JSON).
Each prompt is ``prefix_tokens`` of the text (whole chunks) and the
``SUFFIX_TOKENS`` that follow it, from disjoint windows. For each precision,
the lossless control first, an engine with the connector at that precision
computes every prompt and saves its prefix into a file store of the level's
own; then a fresh engine at the same precision (an empty prefix cache of
vLLM's) serves each prompt: the connector loads the prefix, the suffix is
computed, and ``greedy_tokens`` are decoded greedily.

Every level's tokens are compared with the lossless load's: both engines
cached the same prefix and computed the same suffix, so only the KV differs
(a different hit length alone moves bf16 rounding). Per level:
``identical_prompts`` of ``prompts``, ``mean_first_divergence`` (the mean,
over the prompts that diverged, of the first position whose token differs;
None where none did), ``token_agreement`` (the share of positions with the
same token) and ``loaded_tokens`` (what the connector loaded, in all).

The control: the lossless load must give, on every prompt, the tokens its
saving engine gave from vLLM's own prefix cache holding the KV it computed
(the same hit length): that is the bit-exact promise, and the run stops if it
is broken. Every load must bring the whole prefix as objects of its level, or
the run stops: a lossy row whose prefix was computed, or read lossless, would
measure nothing. ``noise_floor`` is the saving engine's first answer, its
prefix computed in the same pass as the suffix (no hit), against the lossless
load: what bf16 arithmetic in another order alone moves.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_kvcodec.codecs.precision import LOSSY_LABEL, Precision
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.bench.quality_levels import level_name
from vllm_kvcodec.tools.bench.report import machine, wide_table
from vllm_kvcodec.tools.demo import BLOCK_SIZE, Engine, steps

#: Tokens of text after each prefix, computed by every engine: the prefix then ends on a block, as a local hit does.
SUFFIX_TOKENS = 16
CHUNK_TOKENS = 256  # the connector's default chunk_size
CONTEXT = 8192  # SmolLM2's
FLOOR = "bf16 arithmetic alone (prefix computed, no hit)"
REFERENCE = "the lossless load's greedy tokens (same hit length)"


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The engine comparison's scale: ``prompts`` of ``prefix_tokens`` (+ the suffix), ``greedy_tokens`` each."""

    prompts: int = 16
    prefix_tokens: int = 1024
    greedy_tokens: int = 32

    def check(self, levels: list[Precision]) -> None:
        if self.prompts < 1 or self.greedy_tokens < 1:
            raise ConfigError("engine prompts and engine greedy tokens must each be at least 1")
        if self.prefix_tokens <= 0 or self.prefix_tokens % CHUNK_TOKENS:
            raise ConfigError(f"engine prefix tokens {self.prefix_tokens} must be whole chunks of {CHUNK_TOKENS} tokens")
        if self.prefix_tokens + SUFFIX_TOKENS + self.greedy_tokens > CONTEXT:
            raise ConfigError(f"engine prefix tokens + {SUFFIX_TOKENS} + greedy tokens exceed SmolLM2's {CONTEXT}")
        if any(level.full_layers > 30 for level in levels):
            raise ConfigError("full_layers exceeds SmolLM2's 30 layers")


@dataclasses.dataclass
class Answers:
    """One engine's greedy tokens per prompt, and what its connector loaded for each."""

    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    loaded: list[dict[str, float]] = dataclasses.field(default_factory=list)


def run(levels: list[Precision], spec: EngineSpec, source: str | None, threads: int = 1) -> dict[str, Any]:
    """The ``engine`` block: the control, the noise floor and one row per lossy level (see the module's doc).

    The engines run on ``threads`` torch threads, for the rest of the process: vLLM's CPU worker makes
    ``torch.set_num_threads`` a no-op once an engine started. One is the fastest on a shared 2-core host: with two,
    OpenMP threads waiting on each other's barriers while other processes held the cores took 856 s for the
    control's first engine, against 67 s with one."""
    import torch

    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    spec.check(levels)
    torch.set_num_threads(threads)
    span = spec.prefix_tokens + SUFFIX_TOKENS
    ids = sample_token_ids(spec.prompts * span, source)
    prompts = [ids[i * span : (i + 1) * span] for i in range(spec.prompts)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcodec-quality-") as tmp, steps("engine comparison") as say:
        computed, cached = _save(Precision(), prompts, spec, Path(tmp), say, answer=True)
        exact = _load(Precision(), prompts, spec, Path(tmp), say)
        control = _row(Precision(), cached.tokens, exact, spec)
        _check_control(control)
        rows = []
        for level in levels:
            _save(level, prompts, spec, Path(tmp), say, answer=False)
            rows.append(_row(level, exact.tokens, _load(level, prompts, spec, Path(tmp), say), spec))
    floor = {**_compare(exact.tokens, computed.tokens), "loaded_tokens": _total(computed, "loaded_tokens"),
             "name": FLOOR, "label": FLOOR, "precision": None}
    block = {"label": LOSSY_LABEL, "machine": machine(), "prompts": spec.prompts, "prefix_tokens": spec.prefix_tokens,
             "suffix_tokens": SUFFIX_TOKENS, "greedy_tokens": spec.greedy_tokens, "chunk_tokens": CHUNK_TOKENS,
             "threads": threads, "reference": REFERENCE, "control": control, "noise_floor": floor, "results": rows,
             "seconds": round(time.perf_counter() - started, 1)}
    _print(block)
    return block


def _engine(level: Precision, spec: EngineSpec, root: Path) -> Any:
    """An engine with the connector at ``level`` on the level's own file store under ``root``."""
    tokens = spec.prefix_tokens + SUFFIX_TOKENS + spec.greedy_tokens
    settings: dict[str, Any] = {} if level.lossless else {
        "precision": level.name, "precision_sink_tokens": level.sink_tokens, "precision_full_layers": level.full_layers}
    return Engine(f"file://{root / _store_name(level)}", "rans", max_model_len=-(-tokens // BLOCK_SIZE) * BLOCK_SIZE,
                  **settings)


def _store_name(level: Precision) -> str:
    return f"{level.name}-{level.sink_tokens}-{level.full_layers}"


def _save(level: Precision, prompts: list[list[int]], spec: EngineSpec, root: Path, say, answer: bool
          ) -> tuple[Answers, Answers]:
    """A fresh engine at ``level`` computes each prompt, which saves its prefix. With ``answer``: its greedy tokens
    as computed (no hit), then again from vLLM's prefix cache (the prefix it computed), per prompt."""
    say(f"{level_name(level)}: an engine computes {len(prompts)} prompts and saves their prefixes")
    engine = _engine(level, spec, root)
    computed, cached = Answers(), Answers()
    try:
        for prompt in prompts:
            _answer(engine, prompt, spec.greedy_tokens if answer else 1, computed)
            if answer:
                _answer(engine, prompt, spec.greedy_tokens, cached)
    finally:
        engine.close()  # flushes the saves first
    for name, answers in (("computed", computed), ("cached", cached)):
        if any(a.get("loaded_tokens") for a in answers.loaded):
            raise RuntimeError(f"{level.name}: the saving engine's {name} run loaded from its store, which held "
                               "nothing of that prompt: the reference would not be what its engine computed")
    return computed, cached


def _load(level: Precision, prompts: list[list[int]], spec: EngineSpec, root: Path, say) -> Answers:
    """A fresh engine at ``level``: each prompt's prefix loaded from the store, then its greedy tokens."""
    say(f"{level_name(level)}: a fresh engine loads {len(prompts)} prefixes and decodes greedily")
    engine = _engine(level, spec, root)
    loaded = Answers()
    try:
        for prompt in prompts:
            _answer(engine, prompt, spec.greedy_tokens, loaded)
    finally:
        engine.close()
    for i, got in enumerate(loaded.loaded):
        _check_loaded(level, i, got, spec.prefix_tokens)
    return loaded


def _answer(engine: Any, prompt: list[int], max_tokens: int, into: Answers) -> None:
    before = engine.stats()
    into.tokens.append(engine.generate(prompt, max_tokens)[1])
    into.loaded.append({k: v - before.get(k, 0) for k, v in engine.stats().items() if v != before.get(k, 0)})


def _check_loaded(level: Precision, index: int, got: dict[str, float], prefix_tokens: int) -> None:
    """The whole prefix, every object of ``level``: else the row would not measure the level at all."""
    reads = {k.removeprefix("precision_reads_"): int(v) for k, v in got.items() if k.startswith("precision_reads_")}
    whole = got.get("loaded_tokens", 0) == prefix_tokens and not got.get("load_failures", 0)
    if not whole or set(reads) != {level.name} or reads[level.name] != got.get("loaded_objects", 0):
        raise RuntimeError(f"{level.name}: prompt {index} loaded {int(got.get('loaded_tokens', 0))} of its "
                           f"{prefix_tokens} prefix tokens, objects read by precision {reads or 'none'}, "
                           f"{int(got.get('load_failures', 0))} failures: refusing a row that would not measure "
                           f"{level.name}")


def _compare(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """Identical answers, the mean first divergence (over diverged prompts) and the positional token agreement."""
    firsts = [next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None) for ref, got in zip(reference, tokens)]
    diverged = [f for f in firsts if f is not None]
    same = [sum(a == b for a, b in zip(ref, got)) / len(ref) for ref, got in zip(reference, tokens)]
    return {"identical_prompts": len(firsts) - len(diverged), "prompts": len(firsts),
            "mean_first_divergence": statistics.mean(diverged) if diverged else None,
            "first_divergence": firsts, "token_agreement": statistics.mean(same)}


def _row(level: Precision, reference: list[list[int]], answers: Answers, spec: EngineSpec) -> dict[str, Any]:
    name = level_name(level)
    return {"precision": dataclasses.asdict(level), "name": name,
            "label": name if level.lossless else f"{name} ({LOSSY_LABEL})", **_compare(reference, answers.tokens),
            "loaded_tokens": _total(answers, "loaded_tokens"), "loaded_bytes": _total(answers, "loaded_bytes"),
            f"precision_reads_{level.name}": _total(answers, f"precision_reads_{level.name}")}


def _total(answers: Answers, counter: str) -> int:
    return int(sum(a.get(counter, 0) for a in answers.loaded))


def _check_control(control: dict[str, Any]) -> None:
    """A lossless load that changes a greedy token breaks the bit-exact promise: no lossy row would mean anything."""
    if control["identical_prompts"] != control["prompts"]:
        raise RuntimeError(f"the lossless control is not exact: {control['prompts'] - control['identical_prompts']} "
                           f"of {control['prompts']} prompts decode differently after a lossless load than from "
                           f"vLLM's own prefix cache (first divergences {control['first_divergence']})")


def _print(block: dict[str, Any]) -> None:
    rows = [block["noise_floor"], block["control"], *block["results"]]
    wide_table(f"Through vLLM with the connector: {block['prompts']} prompts of {block['prefix_tokens']} loaded + "
               f"{block['suffix_tokens']} computed tokens, {block['greedy_tokens']} greedy tokens, against "
               f"{block['reference']}; every lossy row: {LOSSY_LABEL}",
               ["precision", "loaded tokens", "identical prompts", "mean first divergence", "token agreement"],
               [[r["label"], str(r["loaded_tokens"]), f"{r['identical_prompts']}/{r['prompts']}",
                 "-" if r["mean_first_divergence"] is None else f"{r['mean_first_divergence']:.1f}",
                 f"{r['token_agreement']:.4f}"] for r in rows], width=150)


__all__ = ["FLOOR", "SUFFIX_TOKENS", "EngineSpec", "run"]
