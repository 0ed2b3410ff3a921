"""The plug-in's settings, read from LMCache's ``extra_config`` (no lmcache import here).

LMCache hands every remote storage plug-in the whole ``extra_config`` dict; a
plug-in instance named ``kvcodec`` (or ``kvcodec.<instance>``) reads the keys
``remote_storage_plugin.<name>.<setting>``:

``store`` (required)
    a store URL of :func:`storage.open_store`: ``redis://host:6379/0``,
    ``rediss://...``, ``redis+cluster://...``, ``mooncake://master:port?...``, ``file:///path``,
    ``memory://name``.
``codec``
    a codec id or config dict (``rans``, ``zstd``, ``splitzip``, ``raw``,
    ``video``; dict form ``{"id": "zstd", "level": 3}``). Default ``rans``. A
    codec that cannot hold a dtype bit-exactly (rans/splitzip/video and
    float16) is replaced by ``zstd`` for that dtype, and the choice is logged.
``threads``
    threads that encode, decode and do the store I/O of gets and puts
    (default: the CPU count, at most 4).
``namespace``
    a salt mixed into every key: two deployments with different namespaces
    never read each other's chunks even on one shared store.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vllm_kvcodec.codecs import policy

PLUGIN_TYPE = "kvcodec"
_KNOWN = {"module_path", "class_name", "store", "codec", "threads", "namespace"}


class PluginConfigError(ValueError):
    """The plug-in's extra_config entries are missing or unusable."""


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    plugin_name: str
    store: str
    codec: str | dict[str, Any] = policy.DEFAULT_CODEC
    codec_explicit: bool = False
    threads: int = 4
    namespace: str = ""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, plugin_name: str | None) -> "PluginSettings":
        name = plugin_name or PLUGIN_TYPE
        prefix = f"remote_storage_plugin.{name}."
        extra = dict(extra or {})
        mine = {k[len(prefix):]: v for k, v in extra.items() if isinstance(k, str) and k.startswith(prefix)}
        unknown = sorted(set(mine) - _KNOWN)
        if unknown:
            raise PluginConfigError(
                f"unknown extra_config entries {', '.join(prefix + u for u in unknown)}; "
                f"known: {', '.join(prefix + k for k in sorted(_KNOWN))}"
            )
        store = mine.get("store")
        if not isinstance(store, str) or not store.strip():
            raise PluginConfigError(
                f"extra_config needs '{prefix}store', a store URL such as redis://host:6379/0 or file:///path"
            )
        codec = mine.get("codec")
        explicit = codec not in (None, "")
        if not explicit:
            codec = policy.DEFAULT_CODEC
        if not isinstance(codec, (str, dict)):
            raise PluginConfigError(f"'{prefix}codec' must be a codec id or a config dict, not {codec!r}")
        if codec == policy.AUTO:
            raise PluginConfigError(f"'{prefix}codec: auto' is a KVCodecConnector feature; name a codec here (e.g. rans)")
        threads_raw = mine.get("threads", min(4, os.cpu_count() or 1))
        try:
            threads = int(threads_raw)
        except (TypeError, ValueError):
            raise PluginConfigError(f"'{prefix}threads' must be an integer, not {threads_raw!r}") from None
        if not 1 <= threads <= 64:
            raise PluginConfigError(f"'{prefix}threads' must be between 1 and 64, not {threads}")
        namespace = mine.get("namespace", "")
        if not isinstance(namespace, str):
            raise PluginConfigError(f"'{prefix}namespace' must be a string, not {namespace!r}")
        return cls(name, store.strip(), codec, explicit, threads, namespace)
