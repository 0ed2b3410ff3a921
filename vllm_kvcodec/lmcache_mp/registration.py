"""Registers the kvcodec serdes under their names with LMCache's own serde registry (``register_serde_factory``).

LMCache builds a serde by name only if some imported module registered it. Its
MP server imports third-party code in one place before it builds the L2 adapters
and their serdes: an L2 adapter of ``"type": "plugin"`` names a ``module_path``
that it imports. Importing :mod:`vllm_kvcodec.lmcache_mp` (our plug-in adapter's
module) runs :func:`register_serdes`; a server that uses only LMCache's own
adapters starts through :mod:`vllm_kvcodec.lmcache_mp.server`, which calls it
and then runs LMCache's server unchanged.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import SerdeProcessor
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.lmcache_mp.serde import CodecChoice, KVCodecDeserializer, KVCodecSerializer, parse_fixed_ratio

#: Serde name -> codec id it is named after (None: the codec policy's default per dtype).
SERDES: dict[str, str | None] = {
    "kvcodec-rans": "rans",
    "kvcodec-splitzip": "splitzip",
    "kvcodec-zstd": "zstd",
    "kvcodec-raw": "raw",
    "kvcodec-auto": None,
}
_SERDE_KEYS = {"fixed_ratio", "max_workers"}


def build_serde(name: str, kwargs: dict[str, object]) -> SerdeProcessor:
    """The processor for ``{"type": name, **kwargs}``; a ConfigError (a ValueError) names any bad setting."""
    codec_id = SERDES[name]
    codec_params = {k: v for k, v in kwargs.items() if k not in _SERDE_KEYS}
    if codec_id is None and codec_params:
        raise ConfigError(f"{name} takes no codec parameters, got {sorted(codec_params)}")
    codecs = CodecChoice(name, {"id": codec_id, **codec_params} if codec_id is not None else None)
    workers = kwargs.get("max_workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
        raise ConfigError(f"{name}: max_workers must be an integer in [1, 64], got {workers!r}")
    serializer = KVCodecSerializer(codecs, parse_fixed_ratio(kwargs.get("fixed_ratio")))
    return AsyncSerdeProcessor(serializer, KVCodecDeserializer(), max_workers=workers)


def _factory(name: str) -> Any:
    def create(kwargs: dict[str, object]) -> SerdeProcessor:
        return build_serde(name, kwargs)

    create.__name__ = f"create_{name.replace('-', '_')}_serde"
    return create


def register_serdes() -> list[str]:
    """Register every kvcodec serde not yet registered (a second import registers nothing); returns the names."""
    known = set(get_registered_serde_types())
    for name in SERDES:
        if name not in known:
            register_serde_factory(name, _factory(name))
    return list(SERDES)
