"""The precision levels ``bench quality`` measures, as its options write them and its tables show them."""

from __future__ import annotations

import dataclasses

from vllm_kvcodec.codecs.precision import Precision, parse_precision
from vllm_kvcodec.errors import ConfigError


def parse_level(spec: str) -> Precision:
    """``int8`` or ``int4,sink_tokens=64,full_layers=2``: a level and what it keeps at full precision."""
    name, *options = [part.strip() for part in spec.split(",")]
    kept: dict[str, int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("sink_tokens", "full_layers") or not value.strip().isdigit():
            raise ConfigError(f"precision option {option!r} in {spec!r} is not sink_tokens=N or full_layers=N")
        kept[key] = int(value)
    return dataclasses.replace(parse_precision(name), **kept)


def level_name(level: Precision) -> str:
    """``int4`` or ``int4+64 sink tokens+2 layers``, as tables and charts show it (without the lossy label)."""
    kept = [f"{level.sink_tokens} sink tokens"] * bool(level.sink_tokens)
    kept += [f"{level.full_layers} layers"] * bool(level.full_layers)
    return "+".join([level.name, *kept])
