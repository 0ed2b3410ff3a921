"""Codec ids to classes, ours and third parties', the way numcodecs keeps them.

Ours register when :mod:`vllm_kvcodec.codecs` is imported. A third-party
codec ships in its own distribution and names its class in the entry-point
group :data:`ENTRY_POINTS`, as a numcodecs plug-in does in ``numcodecs.codecs``::

    [project.entry-points."vllm_kvcodec.codecs"]
    my_codec = "my_package.codec:MyCodec"   # MyCodec.codec_id == "my_codec"

:func:`get_codec` looks an id it does not know up there and imports the plug-in
then, so a chunk whose header names a plug-in codec decodes wherever that
plug-in is installed, and a config may name it, without the plug-in being
imported anywhere else. Where it is not installed, the chunk is refused by name
(the load recomputes it).
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.errors import ConfigError

#: The entry-point group third-party codecs register in.
ENTRY_POINTS = "vllm_kvcodec.codecs"

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` reachable by its ``codec_id``."""
    existing = _REGISTRY.get(cls.codec_id)
    if existing is not None and existing is not cls:
        raise ConfigError(f"codec id {cls.codec_id!r} is already registered by {existing.__name__}")
    _REGISTRY[cls.codec_id] = cls
    return cls


def codec_ids() -> list[str]:
    """Every codec id this process can build: registered, or offered by an installed plug-in."""
    return sorted(set(_REGISTRY) | set(_plug_ins()))


def get_codec(spec: str | dict[str, Any] | Codec, **params: Any) -> Codec:
    """Build a codec from an id (plus keyword parameters), a config dict, or pass one through."""
    if isinstance(spec, Codec):
        return spec
    config = {"id": spec, **params} if isinstance(spec, str) else dict(spec)
    codec_id = config.get("id")
    cls = (_REGISTRY.get(codec_id) or _load_plug_in(codec_id)) if isinstance(codec_id, str) else None
    if cls is None:
        raise ConfigError(f"unknown codec {codec_id!r}; known codecs: {', '.join(codec_ids())} (a third-party codec "
                          f"is found once its distribution, which names it in the entry-point group {ENTRY_POINTS!r}, "
                          "is installed)")
    return cls.from_config(config)


@functools.lru_cache(maxsize=1)
def _plug_ins() -> dict[str, metadata.EntryPoint]:
    """The installed plug-ins' codecs by id (read once per process: a chunk naming a missing codec costs no scan)."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINTS)}


def _load_plug_in(codec_id: str) -> type[Codec] | None:
    """Import the plug-in that offers ``codec_id`` and register its class (None: no installed plug-in offers it)."""
    entry = _plug_ins().get(codec_id)
    if entry is None:
        return None
    try:
        cls = entry.load()
    except Exception as exc:  # noqa: BLE001 - any import failure of someone else's package: one clear error
        raise ConfigError(f"codec {codec_id!r}: its plug-in {entry.value} failed to import: "
                          f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Codec) and getattr(cls, "codec_id", None) == codec_id):
        raise ConfigError(f"codec {codec_id!r}: its plug-in {entry.value} is not a Codec subclass whose codec_id is "
                          f"{codec_id!r}")
    return register_codec(cls)
