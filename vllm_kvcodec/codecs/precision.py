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
from typing import Any

from vllm_kvcodec.errors import ConfigError

LOSSLESS = "lossless"
#: The connector's adaptive setting: the lossless object and a lossy variant stored, the variant read per chunk
#: where the link is too slow for the lossless one (connector only; never a level of a stored object).
AUTO = "auto"
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

    def key(self) -> str:
        """The level and what it keeps exact, as a key namespace names it (``int8``, ``int4+sink4+full2``): objects
        that keep other tokens or layers exact are another namespace's. "" for lossless (no field in the digest)."""
        if self.lossless:
            return ""
        keeps = (f"+sink{self.sink_tokens}" if self.sink_tokens else "") + (f"+full{self.full_layers}" if self.full_layers else "")
        return self.name + keeps

    def within(self, first_layer: int, layers: int, tokens: int, first_chunk: bool) -> "Precision":
        """This precision for one object: ``layers`` model layers from ``first_layer`` (a layer group keeps only its
        part of the first ``full_layers``) and ``tokens`` tokens of a chunk (only a sequence's first chunk holds its
        first ``sink_tokens``)."""
        full = min(max(self.full_layers - first_layer, 0), layers)
        sink = min(self.sink_tokens, tokens) if first_chunk else 0
        return dataclasses.replace(self, sink_tokens=sink, full_layers=full)


def parse_precision(spec: "str | Precision | None") -> Precision:
    """``None``/``"lossless"``/``"int8"``... or a :class:`Precision`."""
    if isinstance(spec, Precision):
        return spec
    return Precision(LOSSLESS if spec is None else str(spec).lower())


def stored_precision(codec_config: dict[str, Any]) -> str:
    """What a stored object holds, by its header's codec config: a lossy level (``quantized``), else lossless."""
    if codec_config.get("id") != "quantized":
        return LOSSLESS
    return next((name for name, bits in LEVELS.items() if bits == codec_config.get("bits")), "lossy")
