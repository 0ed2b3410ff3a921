"""What a lossy precision level costs in accuracy, on real SmolLM2: LOSSY: NOT BIT-EXACT.

For each window of a local text and each prefix length (whole 256-token
chunks), the prefix runs through SmolLM2-135M in transformers (bf16), its KV
(K after RoPE, V) is cut into the canonical chunks the connector stores,
``[layers, 2, chunk_tokens, kv_heads, head_dim]``, and each chunk goes through
``encode_chunk(..., precision=level)`` and ``decode_chunk``. The decoded KV is
put back into a transformers cache and the continuation is scored
teacher-forced, against the same continuation scored on the KV as computed:

- ``delta_nll``: mean over continuation tokens of NLL(level) - NLL(computed KV), nats per token, with a 95 %
  interval from a percentile bootstrap over whole continuations (tokens of one continuation are correlated:
  resampling them one by one would understate the interval); none from fewer than two continuations;
- ``kl_mean`` / ``kl_p99``: KL(computed || level) of the next-token distributions, per position;
- ``top1_agreement``: the share of positions whose most likely next token is the same;
- ``first_greedy_divergence``: the computed KV's greedy continuation is scored in one pass on both KVs; the
  first position whose most likely token differs is where greedy decoding from the lossy KV leaves it (None:
  not within ``greedy_tokens``);
- ``ratio``: raw bytes of the prefix chunks / the bytes ``encode_chunk`` stored for them (header, scales and
  checksum included); ``bits_per_value`` = 16 / ratio for bf16.

``noise_floor`` is the same comparison with no codec at all: the prefix and
continuation scored in one forward pass, against the prefix's KV handed to
the continuation. Both are exact; only bf16 arithmetic in another order
differs, so a level whose figures sit at this floor is indistinguishable, on
this model, from the rounding every forward pass already does.

The same pipeline at ``precision=lossless`` is the control: bit-exact chunks
must read exactly 0 / 0 / 1.0 and never diverge, or the run stops (a
pipeline that perturbed the KV by itself would make every lossy figure
meaningless). Sink tokens are kept in a sequence's first chunk only, as the
connector stores them; ``full_layers`` in every chunk.

Scores run on one thread by default: figures are deterministic for a given
machine, and the model is fastest that way on a shared 2-core host.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvcodec.codecs.precision import LOSSY_LABEL, Precision
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.tools.bench.quality_levels import level_name, parse_level
from vllm_kvcodec.tools.bench.report import console, machine, wide_table, write_json

if TYPE_CHECKING:
    from vllm_kvcodec.tools.bench.quality_engine import EngineSpec

CI = ("95 % percentile bootstrap over whole continuations (10000 resamples, seed 0); "
      "tokens within a continuation are correlated, so they are not resampled one by one")
BOOTSTRAP = 10_000
#: The reference row: no codec, the same tokens scored in one forward pass instead of prefix, then continuation.
FLOOR = "bf16 arithmetic alone (one pass)"
#: The run docs/precision.md quotes (in a checkout; the notebook reads it).
RECORDED = Path(__file__).resolve().parents[3] / "docs" / "data" / "quality.json"
#: What the papers report, on their models and tasks, not ours. Neither gives a ΔNLL; ``ratio`` is drawn at
#: 16 / ratio bits per value, as if against 16-bit KV, which ``against`` qualifies (docs/precision.md).
REPORTED = [
    {"name": "CacheGen", "ratio": [3.5, 4.3], "quality": "'negligible' impact on accuracy or perplexity",
     "against": "the KV-reusing systems it compares with (its abstract), not stated here as 16-bit KV",
     "source": "CacheGen (arXiv 2310.07240, SIGCOMM 2024): four LLMs, four datasets, 662 contexts"},
    {"name": "KVCodec, layout", "ratio": [5.92, 5.92], "quality": "none reported in our notes",
     "against": "16-bit KV: 2.96x over its 8-bit integers (its layout ablation) x 2 for 8 of 16 bits (our arithmetic)",
     "source": "KVCodec (arXiv 2602.09725): LWM-7B-1M, Yi-34B-200K, Llama-3-70B"},
    {"name": "KVCodec, headline", "ratio": [10.0, 10.0], "quality": "none reported in our notes",
     "against": "bf16, 8-bit quantisation included (our reading notes, not the full text)",
     "source": "KVCodec (arXiv 2602.09725)"},
]


@dataclasses.dataclass
class Scores:
    """Per-token figures of one precision level, pooled over continuations (one array per continuation)."""

    delta_nll: list[np.ndarray] = dataclasses.field(default_factory=list)
    kl: list[np.ndarray] = dataclasses.field(default_factory=list)
    agree: list[np.ndarray] = dataclasses.field(default_factory=list)
    divergence: list[int | None] = dataclasses.field(default_factory=list)
    prefix: list[int] = dataclasses.field(default_factory=list)
    raw_bytes: int = 0
    stored_bytes: int = 0
    bit_exact: bool = True

    def add(self, base: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor],
            targets: list[int], prefix: int) -> None:
        """One continuation: (teacher-forced, greedy path) log-probabilities of the computed KV and of this one."""
        delta, kl, agree = compare(base[0], other[0], targets)
        self.delta_nll.append(delta)
        self.kl.append(kl)
        self.agree.append(agree)
        self.divergence.append(first_divergence(base[1], other[1]))
        self.prefix.append(prefix)


def chunk_precision(level: Precision, index: int) -> Precision:
    """The attention sinks are a sequence's first tokens: only its first chunk keeps them."""
    return level if index == 0 else dataclasses.replace(level, sink_tokens=0)


def through_codec(kv: torch.Tensor, level: Precision, chunk_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """``kv`` after storing and loading it chunk by chunk at ``level``, and each chunk's stored bytes."""
    blobs = [encode_chunk(chunk.contiguous(), precision=chunk_precision(level, i))
             for i, chunk in enumerate(kv.split(chunk_tokens, dim=2))]
    return torch.cat([decode_chunk(b) for b in blobs], dim=2), [len(b) for b in blobs]


def log_probs(model, kv: torch.Tensor, inputs: list[int]) -> torch.Tensor:
    """Next-token log-probabilities (float64) at each of ``inputs``, fed after the prefix whose KV is ``kv``."""
    from vllm_kvcodec.tools.smollm2 import cache_from_kv

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([inputs]), past_key_values=cache_from_kv(kv, model.config), use_cache=True)
    return torch.log_softmax(out.logits[0].double(), dim=-1)


def greedy(model, kv: torch.Tensor, first: int, n: int) -> list[int]:
    """``first``, then the n - 1 tokens greedy decoding from ``kv`` feeds after it (one token per step)."""
    from vllm_kvcodec.tools.smollm2 import cache_from_kv

    cache, tokens = cache_from_kv(kv, model.config), [first]
    with torch.inference_mode():
        while len(tokens) < n:
            logits = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def compare(base: torch.Tensor, other: torch.Tensor, targets: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: NLL(other) - NLL(base) of ``targets``, KL(base || other), and whether their top-1 agree."""
    index = torch.tensor(targets)[:, None]
    delta = base.gather(1, index)[:, 0] - other.gather(1, index)[:, 0]
    kl = (base.exp() * (base - other)).sum(dim=-1)
    agree = base.argmax(dim=-1) == other.argmax(dim=-1)
    return delta.numpy(), kl.numpy(), agree.numpy()


def first_divergence(base: torch.Tensor, other: torch.Tensor) -> int | None:
    differ = (base.argmax(dim=-1) != other.argmax(dim=-1)).nonzero()
    return int(differ[0, 0]) if len(differ) else None


def one_pass(model, prefix: list[int], inputs: list[int]) -> torch.Tensor:
    """:func:`log_probs` of the same tokens in one forward pass over prefix and inputs, no cache handed over: what
    bf16 arithmetic alone moves (the prefix's KV computed in another batch shape, attention in another order)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prefix + inputs])).logits[0, len(prefix) :]
    return torch.log_softmax(logits.double(), dim=-1)


def run(
    output: Path | None = None,
    levels: list[str | Precision] | None = None,
    text: Path | None = None,
    prefix_tokens: tuple[int, ...] = (512, 1024, 2048),
    continuation_tokens: int = 128,
    greedy_tokens: int = 64,
    windows: int = 8,
    chunk_tokens: int = 256,
    threads: int = 1,
    engine: "EngineSpec | None" = None,
    teacher_forced: bool = True,
) -> dict[str, Any]:
    """The teacher-forced figures, and with ``engine`` its ``engine`` block (:mod:`.quality_engine`). Without
    ``teacher_forced``, only that block is measured and set in ``output``, whose other figures are kept."""
    from vllm_kvcodec.tools.smollm2 import MODEL_NAME

    wanted = [parse_level(s) if isinstance(s, str) else s for s in levels or ["int8"]]
    _check(wanted, prefix_tokens, continuation_tokens, greedy_tokens, windows, chunk_tokens)
    if not teacher_forced and engine is None:
        raise ConfigError("nothing to measure: the engine comparison is the only part asked for, and it is off")
    if engine is not None:
        engine.check(wanted)
    source = text.read_text(encoding="utf-8") if text is not None else None
    if teacher_forced:
        result = _teacher_forced(wanted, text, source, prefix_tokens, continuation_tokens, greedy_tokens, windows,
                                 chunk_tokens, threads)
    else:
        result = _recorded(output) or {"benchmark": "quality", "label": LOSSY_LABEL, "model": MODEL_NAME}
    if engine is not None:
        from vllm_kvcodec.tools.bench import quality_engine

        result["engine"] = {**quality_engine.run(wanted, engine, source, threads),
                            "text": str(text) if text is not None else "pydoc_data.topics"}
    write_json(result, output)
    return result


def _recorded(output: Path | None) -> dict[str, Any] | None:
    """The figures already in ``output``, kept when only the engine block is measured again."""
    import json

    return json.loads(output.read_text()) if output is not None and output.exists() else None


def _teacher_forced(wanted: list[Precision], text: Path | None, source: str | None, prefix_tokens: tuple[int, ...],
                    continuation_tokens: int, greedy_tokens: int, windows: int, chunk_tokens: int,
                    threads: int) -> dict[str, Any]:
    from vllm_kvcodec.tools.smollm2 import MODEL_NAME, load_model, sample_token_ids

    span = max(prefix_tokens) + max(continuation_tokens, greedy_tokens) + 1
    ids = sample_token_ids(windows * span, source)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load_model()
        variants = [Precision(), *wanted]  # the control first
        scores, floor = [Scores() for _ in variants], Scores()
        with console.status("") as status:
            for w in range(windows):
                status.update(f"window {w + 1}/{windows}: prefill of {max(prefix_tokens)} tokens")
                _window(model, ids[w * span : (w + 1) * span], variants, scores, floor, prefix_tokens,
                        continuation_tokens, greedy_tokens, chunk_tokens)
    finally:
        torch.set_num_threads(threads_before)
    control, *rows = [_summary(v, s) for v, s in zip(variants, scores)]
    _check_control(control)
    noise = {**_summary(Precision(), floor), "name": FLOOR, "label": FLOOR, "precision": None}
    result = {"benchmark": "quality", "label": LOSSY_LABEL, "machine": machine(), "model": MODEL_NAME,
              "text": str(text) if text is not None else "pydoc_data.topics", "windows": windows,
              "prefix_tokens": list(prefix_tokens), "continuation_tokens": continuation_tokens,
              "greedy_tokens": greedy_tokens, "chunk_tokens": chunk_tokens, "threads": threads, "ci": CI,
              "control": control, "noise_floor": noise, "results": rows, "reported": REPORTED, "targets": _targets(rows)}
    _print(result)
    return result


def _check(levels: list[Precision], prefix_tokens: tuple[int, ...], continuation: int, greedy_n: int, windows: int,
           chunk_tokens: int) -> None:
    if not levels or any(level.lossless for level in levels):
        raise ConfigError("bench quality measures lossy levels (int8, int6, int4); lossless is its control, always run")
    if not prefix_tokens or any(p <= 0 or p % chunk_tokens for p in prefix_tokens):
        raise ConfigError(f"prefix tokens {list(prefix_tokens)} must be whole chunks of {chunk_tokens} tokens")
    if any(level.sink_tokens > chunk_tokens for level in levels):
        raise ConfigError(f"sink tokens are kept in a sequence's first chunk: at most {chunk_tokens}")
    if continuation < 1 or greedy_n < 1 or windows < 1:
        raise ConfigError("continuation tokens, greedy tokens and windows must each be at least 1")


def _window(model, ids: list[int], variants: list[Precision], scores: list[Scores], floor: Scores,
            prefix_tokens: tuple[int, ...], continuation: int, greedy_n: int, chunk_tokens: int) -> None:
    """One window of the text: its longest prefix computed once, each variant's chunks coded once, then every
    prefix length scored on every variant (a shorter prefix's chunks are the longer one's first chunks), and in
    one pass for the noise floor."""
    from vllm_kvcodec.tools.smollm2 import kv_from_cache

    longest = max(prefix_tokens)
    with torch.inference_mode():
        kv = kv_from_cache(model(input_ids=torch.tensor([ids[:longest]]), use_cache=True).past_key_values)
    coded = [through_codec(kv, v, chunk_tokens) for v in variants]
    for p in prefix_tokens:
        cut = kv[:, :, :p]
        inputs, targets = ids[p : p + continuation], ids[p + 1 : p + continuation + 1]
        path = greedy(model, cut, ids[p], greedy_n)
        base = log_probs(model, cut, inputs), log_probs(model, cut, path)
        floor.add(base, (one_pass(model, ids[:p], inputs), one_pass(model, ids[:p], path)), targets, p)
        for (decoded, sizes), s in zip(coded, scores):
            lossy = decoded[:, :, :p]
            s.add(base, (log_probs(model, lossy, inputs), log_probs(model, lossy, path)), targets, p)
            s.raw_bytes += cut.numel() * cut.element_size()
            s.stored_bytes += sum(sizes[: p // chunk_tokens])
            s.bit_exact &= torch.equal(lossy.view(torch.int16), cut.view(torch.int16))


def _summary(level: Precision, s: Scores) -> dict[str, Any]:
    delta, kl, agree = np.concatenate(s.delta_nll), np.concatenate(s.kl), np.concatenate(s.agree)
    ratio = s.raw_bytes / s.stored_bytes if s.stored_bytes else None
    by_prefix = {str(p): {"delta_nll": float(np.concatenate([d for d, q in zip(s.delta_nll, s.prefix) if q == p]).mean()),
                          "top1_agreement": float(np.concatenate([a for a, q in zip(s.agree, s.prefix) if q == p]).mean())}
                 for p in dict.fromkeys(s.prefix)}
    diverged = [d for d in s.divergence if d is not None]
    label = level_name(level) if level.lossless else f"{level_name(level)} ({LOSSY_LABEL})"
    return {"precision": dataclasses.asdict(level), "name": level_name(level), "label": label,
            "bit_exact": s.bit_exact, "ratio": ratio, "bits_per_value": 16 / ratio if ratio else None,
            "delta_nll": float(delta.mean()), "delta_nll_ci95": _bootstrap(s.delta_nll),
            "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "top1_agreement": float(agree.mean()), "tokens_scored": int(delta.size),
            "first_greedy_divergence": s.divergence, "greedy_diverged": len(diverged), "continuations": len(s.divergence),
            "by_prefix": by_prefix}


def _bootstrap(parts: list[np.ndarray]) -> list[float] | None:
    """The 95 % interval of the mean, resampling whole continuations (equal lengths: the mean of their means)."""
    if len(parts) < 2:
        return None
    means = np.array([p.mean() for p in parts])
    picks = np.random.default_rng(0).integers(0, len(means), size=(BOOTSTRAP, len(means)))
    low, high = np.percentile(means[picks].mean(axis=1), [2.5, 97.5])
    return [float(low), float(high)]


def _check_control(control: dict[str, Any]) -> None:
    """The lossless pipeline must leave the scores exactly as they were: else nothing here measures the codec."""
    exact = (control["bit_exact"] and control["delta_nll"] == 0.0 and control["kl_mean"] == 0.0
             and control["kl_p99"] == 0.0 and control["top1_agreement"] == 1.0 and not control["greedy_diverged"])
    if not exact:
        raise RuntimeError(f"the lossless control is not exact (bit-exact {control['bit_exact']}, ΔNLL "
                           f"{control['delta_nll']!r}, KL {control['kl_mean']!r}, top-1 {control['top1_agreement']!r}): "
                           "the pipeline perturbs the KV by itself, so no lossy figure would mean anything")


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: int8 at least 2x with ΔNLL at most 0.01 nats per token; a lower level at least 4x."""
    plain = [r for r in rows if not r["precision"]["sink_tokens"] and not r["precision"]["full_layers"]]
    out: dict[str, Any] = {}
    for r in plain:
        if r["precision"]["name"] == "int8":
            out["int8 ratio"] = {"value": r["ratio"], "target": ">= 2.0", "met": r["ratio"] >= 2.0}
            out["int8 ΔNLL"] = {"value": r["delta_nll"], "target": "<= 0.01", "met": r["delta_nll"] <= 0.01}
    lower = [r for r in plain if r["precision"]["name"] != "int8"]
    if lower:
        low = min(lower, key=lambda r: r["bits_per_value"])
        out[f"{low['name']} ratio"] = {"value": low["ratio"], "target": ">= 4.0", "met": low["ratio"] >= 4.0}
        out[f"{low['name']} ΔNLL"] = {"value": low["delta_nll"], "target": "stated", "met": True}
    return out


def _print(result: dict[str, Any]) -> None:
    rows = [result["noise_floor"], result["control"], *result["results"]]
    wide_table(f"{result['model']} on {result['text']}: prefixes {result['prefix_tokens']} x {result['windows']} "
               f"windows, {result['continuation_tokens']} tokens scored each, greedy divergence within "
               f"{result['greedy_tokens']}; every lossy row: {LOSSY_LABEL}",
               ["precision", "ratio", "bits/value", "ΔNLL nats/token", "95 % CI", "KL mean", "KL p99", "top-1",
                "greedy diverged"],
               [[r["label"], _num(r["ratio"], ".3f"), _num(r["bits_per_value"], ".2f"), f"{r['delta_nll']:.5f}",
                 _ci(r["delta_nll_ci95"]), f"{r['kl_mean']:.2e}", f"{r['kl_p99']:.2e}", f"{r['top1_agreement']:.4f}",
                 f"{r['greedy_diverged']}/{r['continuations']}"] for r in rows], width=180)
    for name, t in result["targets"].items():
        console.print(f"{name} ({LOSSY_LABEL}): {t['value']:.4f} (target {t['target']}) "
                      f"{'met' if t['met'] else 'NOT met'}")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ci(ci: list[float] | None) -> str:
    return "-" if ci is None else f"[{ci[0]:.5f}, {ci[1]:.5f}]"


__all__ = ["CI", "FLOOR", "RECORDED", "REPORTED", "chunk_precision", "level_name", "one_pass", "parse_level", "run",
           "through_codec"]
