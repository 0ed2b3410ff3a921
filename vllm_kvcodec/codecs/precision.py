"""Precision levels: ``lossless`` (the default, bit-exact) or a lossy level named by its bits.

Lossless coding of bf16 KV saturates near 1.5x (docs/codecs.md): the
sign+mantissa bits are incompressible. The papers this project comes from
reach 3-6x on slow links by quantising first (KVCodec: 8-bit integers coded
losslessly; CacheGen: 4-5 bit bins). A lossy level stores each value as a
``bits``-bit integer with scales chosen as KIVI and KVQuant found best (keys
per channel over the chunk's tokens, values per token, per layer and KV head;
:mod:`.quantized`). It is opt-in everywhere, labelled lossy, and never a
default: nothing stores a lossy object unless ``precision`` names a level.
"""

from __future__ import annotations

import dataclasses

from vllm_kvcodec.errors import ConfigError

LOSSLESS = "lossless"
#: Lossy levels by name -> bits per value before entropy coding.
LEVELS = {"int8": 8, "int6": 6, "int4": 4}
#: What a lossy level is called wherever it is shown (logs, benchmarks, docs).
LOSSY_LABEL = "lossy: not bit-exact"


@dataclasses.dataclass(frozen=True)
class Precision:
    """A level and what it keeps at full precision: the first ``full_layers`` layers of the model and the first
    ``sink_tokens`` tokens of the sequence (the attention sinks CacheGen and KVQuant keep exact)."""

    name: str = LOSSLESS
    sink_tokens: int = 0
    full_layers: int = 0

    def __post_init__(self) -> None:
        if self.name != LOSSLESS and self.name not in LEVELS:
            raise ConfigError(f"precision {self.name!r} is not one of {', '.join([LOSSLESS, *LEVELS])}")
        if self.sink_tokens < 0 or self.full_layers < 0:
            raise ConfigError("precision sink_tokens and full_layers must be >= 0")

    @property
    def lossless(self) -> bool:
        return self.name == LOSSLESS

    @property
    def bits(self) -> int:
        """Bits per quantised value (16 for lossless: the source's own)."""
        return LEVELS.get(self.name, 16)

    def label(self) -> str:
        return self.name if self.lossless else f"{self.name} ({LOSSY_LABEL})"


def parse_precision(spec: "str | Precision | None") -> Precision:
    """``None``/``"lossless"``/``"int8"``... or a :class:`Precision`."""
    if isinstance(spec, Precision):
        return spec
    return Precision(LOSSLESS if spec is None else str(spec).lower())
