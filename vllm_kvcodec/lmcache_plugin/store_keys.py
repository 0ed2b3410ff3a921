"""LMCache ``CacheEngineKey`` -> store key, and back for listing.

A key's string form is ``<model>@<world_size>@<worker_id>@<chunk hash hex>@<dtype>``
(``@<layer_id>`` after the dtype for layer-wise keys, then ``@tag%value`` for
``lmcache.tag.*`` request tags). Everything but the chunk hash is the
*namespace* of the key: it goes through XXH3-128 together with this key
layout's version, our chunk format version and the plug-in's ``namespace``
salt, so the store key is short, printable ASCII whatever the model name is::

    lmc/v2/<32 hex digits of the namespace digest>/<chunk hash hex>

Next to the chunks of each namespace lies one small descriptor,
``lmc/v2/<digest>/ns`` (``n`` and ``s`` are not hex digits, so it never
collides with a chunk), holding the namespace's two halves of the key string:
that is how ``list()`` gives back LMCache's own key strings.

Each KV group's chunk in a stored value is bound to ``<store key>#<group>``
(:func:`group_binding`), so a value read from another key's slot is refused.
Layout 1 (``lmc/v1/``) held unbound chunks: this reader never looks there, so
what an older plug-in stored is neither found by a lookup nor served.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import xxhash

from vllm_kvcodec.format import VERSION as FORMAT_VERSION

KEY_LAYOUT_VERSION = 2  # 2: every chunk is bound to its key (1 held unbound chunks, never read now)
ROOT = f"lmc/v{KEY_LAYOUT_VERSION}/"
DESCRIPTOR = "ns"
# Chunk hashes are ints (hex, maybe with a '-') or bytes (hex); anything longer
# than this is hashed, so a key always stays far below the store limit of 512.
_MAX_HASH_CHARS = 128


@dataclasses.dataclass(frozen=True)
class KeyNamespace:
    head: str  # "<model>@<world_size>@<worker_id>"
    tail: str  # "<dtype>[@<layer_id>][@tag%value...]"
    digest: str

    def store_key(self, part: str) -> str:
        """Where the chunk ``part`` (:meth:`KeyMapper.split`) of this namespace is stored."""
        return f"{ROOT}{self.digest}/{part}"

    @property
    def descriptor_key(self) -> str:
        return f"{ROOT}{self.digest}/{DESCRIPTOR}"

    def descriptor(self) -> bytes:
        return json.dumps({"head": self.head, "tail": self.tail, "layout": KEY_LAYOUT_VERSION},
                          sort_keys=True, separators=(",", ":")).encode()

    def key_string(self, hash_hex: str) -> str:
        return f"{self.head}@{hash_hex}@{self.tail}"


def namespace_digest(head: str, tail: str, salt: str = "") -> str:
    blob = json.dumps(
        {"layout": KEY_LAYOUT_VERSION, "format": FORMAT_VERSION, "head": head, "tail": tail, "salt": salt},
        sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    ).encode()
    return xxhash.xxh3_128_hexdigest(blob)


class KeyMapper:
    """Maps CacheEngineKeys to store keys; remembers the namespaces it has seen."""

    def __init__(self, salt: str = "", max_cached: int = 4096) -> None:
        self.salt = salt
        self._cache: dict[tuple[str, str], KeyNamespace] = {}
        self._max_cached = max_cached

    def split(self, key: Any) -> tuple[KeyNamespace, str]:
        """``(namespace, chunk part)`` of an LMCache CacheEngineKey (or LayerCacheEngineKey)."""
        hash_hex = key.chunk_hash_hex
        head = f"{key.model_name}@{key.world_size}@{key.worker_id}"
        full = key.to_string()
        lead = f"{head}@{hash_hex}@"
        if not full.startswith(lead):  # a future key layout: digest everything but the hash
            raise ValueError(f"unexpected CacheEngineKey string {full!r}")
        tail = full[len(lead):]
        ns = self._cache.get((head, tail))
        if ns is None:
            if len(self._cache) >= self._max_cached:
                self._cache.clear()
            ns = KeyNamespace(head, tail, namespace_digest(head, tail, self.salt))
            self._cache[(head, tail)] = ns
        part = hash_hex if len(hash_hex) <= _MAX_HASH_CHARS else "h" + xxhash.xxh3_128_hexdigest(hash_hex.encode())
        return ns, part

    def store_key(self, key: Any) -> str:
        ns, part = self.split(key)
        return ns.store_key(part)


def group_binding(store_key: str, group: int) -> str:
    """What KV group ``group`` of the value under ``store_key`` is bound to: a chunk moved to another key or group
    is refused. The store key names the whole CacheEngineKey (its namespace digest) and the plug-in's salt."""
    return f"{store_key}#{group}"


def parse_store_key(store_key: str) -> tuple[str, str] | None:
    """``(digest, last segment)`` of a key under :data:`ROOT`, else None."""
    if not store_key.startswith(ROOT):
        return None
    rest = store_key[len(ROOT):].split("/")
    if len(rest) != 2 or not rest[0] or not rest[1]:
        return None
    return rest[0], rest[1]


def parse_descriptor(raw: bytes) -> tuple[str, str] | None:
    try:
        d = json.loads(raw)
        return str(d["head"]), str(d["tail"])
    except (ValueError, KeyError, TypeError):
        return None
