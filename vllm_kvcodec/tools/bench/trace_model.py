"""The cost model the trace simulator prices a fleet with: a named model on a named GPU, a link, the codecs.

Every figure is a parameter with a stated source, and every one can be set
on the command line; nothing here is measured on this machine except the
codecs (``docs/data/codecs.json``: ratio and one-thread decode speed on real
SmolLM2 KV, bit-exact).

- **Prefill** of ``n`` new tokens after ``p`` cached ones takes
  ``s_per_token * n + s_per_token2 * ((p + n)**2 - p**2) / 2`` seconds: the
  dense layers' work per token, plus attention, whose work for token ``i``
  grows with ``i``. The two coefficients come from FLOPs: ``2 * parameters``
  per token, ``4 * layers * heads * head_dim`` per pair of tokens (QK and AV),
  over the replica's bf16 peak (NVIDIA's datasheet: H100/H200 SXM 989.4
  dense TFLOPS) times an assumed model FLOPs utilisation (``mfu``, 0.4).
- **A load** of a hit costs its far bytes over the link, plus the raw bytes
  over the codec's decode speed (one-thread speed measured here, times
  ``decode_threads``; raw needs no decode). Near-tier reads cost their bytes
  over ``near_gbps``. The connector streams layer groups while the rest of the
  prompt is computed, so a request's prefill time is ``max(load, prefill)``.
- **TTFT** adds the wait for its worker: each worker runs prefills one after
  another in arrival order (decode steps and batching are not modelled).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

#: H100 / H200 SXM dense bf16 peak (NVIDIA datasheets), FLOP/s.
H100_BF16_FLOPS = 989.4e12
CODECS_JSON = Path(__file__).resolve().parents[3] / "docs" / "data" / "codecs.json"
#: Codec ratios and one-thread decode MB/s measured in docs/data/codecs.json (used when the file is absent).
MEASURED_CODECS = {"raw": (1.0, None), "splitzip": (1.3307, 3789.6), "rans": (1.5126, 468.2),
                   "zstd": (1.4600, 1173.9), "video": (1.4622, 81.3)}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model replica: its KV bytes per token and its prefill cost coefficients."""

    name: str
    kv_bytes_per_token: int
    s_per_token: float
    s_per_token2: float
    source: str
    gpus: int = 1  # per replica: a replica-second of prefill is this many GPU-seconds

    def prefill_s(self, new: int, cached: int) -> float:
        end = cached + new
        return self.s_per_token * new + self.s_per_token2 * (end * end - cached * cached) / 2.0


def _from_flops(name: str, params: float, layers: int, heads: int, head_dim: int, kv_heads: int, gpus: int,
                mfu: float = 0.4, dtype_bytes: int = 2) -> ModelSpec:
    flops = gpus * H100_BF16_FLOPS * mfu
    kv = layers * kv_heads * head_dim * 2 * dtype_bytes
    return ModelSpec(name, kv, 2 * params / flops, 4 * layers * heads * head_dim / flops,
                     f"{params / 1e9:g}B parameters, {layers} layers, {heads} heads x {head_dim}, {kv_heads} KV heads; "
                     f"{gpus} x H100 bf16 {H100_BF16_FLOPS / 1e12:.1f} TFLOPS at MFU {mfu}", gpus)


#: Named replicas (architectures from the models' published configs).
MODELS = {
    "llama-70b": _from_flops("llama-70b", 70.6e9, 80, 64, 128, 8, gpus=8),  # 320 KiB of bf16 KV per token
    "llama-8b": _from_flops("llama-8b", 8.03e9, 32, 32, 128, 8, gpus=1),  # 128 KiB per token
    "smollm2-135m": _from_flops("smollm2-135m", 0.135e9, 30, 9, 64, 3, gpus=1),  # 23,040 B per token
}


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    name: str
    ratio: float
    decode_mbps_one_thread: float | None  # None: no decode (raw)


def measured_codecs(path: Path = CODECS_JSON) -> dict[str, CodecSpec]:
    """Each codec's ratio and one-thread decode speed as measured on real KV (the file, else its last figures)."""
    table = dict(MEASURED_CODECS)
    if path.is_file():
        for row in json.loads(path.read_text())["results"]:
            cid = row["codec"]["id"]
            if cid == "video" and row["codec"].get("backend") != "hevc":
                continue  # the video codec's default backend
            if cid == "zstd" and row["codec"].get("level") != 1:
                continue
            table[cid] = (1.0 if cid == "raw" else row["ratio"], None if cid == "raw" else row["decode_MBps"])
    return {name: CodecSpec(name, ratio, mbps) for name, (ratio, mbps) in table.items()}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What a load and a prefill cost on one replica of ``model``, reading through ``link_gbps``."""

    model: ModelSpec
    codec: CodecSpec
    link_gbps: float = 100.0  # a 100 Gbit/s NIC to the shared store
    near_gbps: float = 200.0  # host memory / local NVMe behind a near tier
    decode_threads: int = 16
    overlap: bool = True  # layer groups stream while the rest of the prompt is computed
    overhead_s: float = 0.0  # added to each TTFT, the worker not held by it (HTTP, tokenizing, scheduling)

    def object_bytes(self, tokens: int) -> int:
        return int(round(tokens * self.model.kv_bytes_per_token / self.codec.ratio))

    def load_s(self, far_bytes: int, near_bytes: int, raw_bytes: int) -> float:
        t = far_bytes * 8 / (self.link_gbps * 1e9) + near_bytes * 8 / (self.near_gbps * 1e9)
        if self.codec.decode_mbps_one_thread:
            t += raw_bytes / (self.codec.decode_mbps_one_thread * 1e6 * self.decode_threads)
        return t

    def request_s(self, prefill_s: float, load_s: float) -> float:
        """How long a request holds its worker."""
        return max(prefill_s, load_s) if self.overlap else prefill_s + load_s

    def describe(self) -> dict[str, Any]:
        return {"model": dataclasses.asdict(self.model), "codec": dataclasses.asdict(self.codec),
                "link_gbps": self.link_gbps, "near_gbps": self.near_gbps, "decode_threads": self.decode_threads,
                "overlap": self.overlap, "overhead_s": self.overhead_s}


def model_spec(name: str, kv_bytes_per_token: int | None = None, s_per_token: float | None = None,
               s_per_token2: float | None = None) -> ModelSpec:
    """A named replica, any of its figures overridden (a one-line error for an unknown name)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    changes = {k: v for k, v in (("kv_bytes_per_token", kv_bytes_per_token), ("s_per_token", s_per_token),
                                 ("s_per_token2", s_per_token2)) if v is not None}
    return dataclasses.replace(spec, **changes, source=spec.source + (" (overridden)" if changes else "")) \
        if changes else spec


def break_even_gbps(cost: CostModel, context: int = 8192) -> float:
    """Link Gbit/s below which loading a ``context``-token prefix takes longer than computing it (inf: never wins)."""
    compute = cost.model.prefill_s(context, 0)
    raw = context * cost.model.kv_bytes_per_token
    decode = cost.load_s(0, 0, raw)
    if decode >= compute:
        return float("inf")
    return cost.object_bytes(context) * 8 / (compute - decode) / 1e9
