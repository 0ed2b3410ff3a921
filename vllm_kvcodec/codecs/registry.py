"""Codec ids to classes. Third-party codecs register the same way ours do."""

from __future__ import annotations

from typing import Any

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.errors import ConfigError

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` reachable by its ``codec_id``."""
    existing = _REGISTRY.get(cls.codec_id)
    if existing is not None and existing is not cls:
        raise ConfigError(f"codec id {cls.codec_id!r} is already registered by {existing.__name__}")
    _REGISTRY[cls.codec_id] = cls
    return cls


def codec_ids() -> list[str]:
    return sorted(_REGISTRY)


def get_codec(spec: str | dict[str, Any] | Codec, **params: Any) -> Codec:
    """Build a codec from an id (plus keyword parameters), a config dict, or pass one through."""
    if isinstance(spec, Codec):
        return spec
    config = {"id": spec, **params} if isinstance(spec, str) else dict(spec)
    codec_id = config.get("id")
    cls = _REGISTRY.get(codec_id) if isinstance(codec_id, str) else None
    if cls is None:
        raise ConfigError(f"unknown codec {codec_id!r}; known codecs: {', '.join(codec_ids())}")
    return cls.from_config(config)
