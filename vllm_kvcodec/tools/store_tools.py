"""What ``kvcodec inspect`` and ``kvcodec verify`` do to a store: read chunk headers, check checksums.

Objects are read one at a time (bounded memory); only keys under the
connector's ``kvc/`` prefix are considered. Nothing is decoded beyond the
header unless ``verify`` is asked to; both read a store opened read-only, and
only ``verify --delete`` writes (it reopens the store for the deletes).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator

from storage import Store
from vllm_kvcodec.block_refs import is_ref_key
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import read_header
from vllm_kvcodec.keys import KEY_PREFIX


@dataclasses.dataclass
class StoreSummary:
    objects: int = 0
    stored_bytes: int = 0
    raw_bytes: int = 0
    damaged: int = 0
    refs: int = 0  # block refs (block_refs.py): tiny index entries, not chunk objects
    ref_bytes: int = 0
    namespaces: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    codecs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    chunks: set = dataclasses.field(default_factory=set)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0


def connector_keys(store: Store) -> Iterator[str]:
    return store.keys(f"{KEY_PREFIX}/")


def inspect_store(store: Store, progress: Callable[[], None] = lambda: None) -> StoreSummary:
    """Namespaces, chunks, bytes stored vs raw and codecs, from headers (checksums verified)."""
    summary = StoreSummary()
    for key, blob in _objects(store, summary):
        progress()
        summary.objects += 1
        parts = key.split("/")
        try:
            header = read_header(blob)
        except ChunkFormatError:
            summary.damaged += 1
            continue
        summary.stored_bytes += len(blob)
        summary.raw_bytes += header.raw_nbytes
        summary.namespaces[parts[1] if len(parts) > 2 else "?"] += 1
        summary.codecs[header.codec_id] += 1
        summary.chunks.add("/".join(parts[1:3]))
    return summary


def verify_store(store: Store, progress: Callable[[], None] = lambda: None) -> list[tuple[str, str]]:
    """``(key, reason)`` of every damaged object (the store may be read-only: nothing is changed)."""
    from vllm_kvcodec.format import decode_chunk

    damaged = []
    for key, blob in _objects(store):
        progress()
        try:
            decode_chunk(blob)
        except ChunkFormatError as exc:
            damaged.append((key, str(exc)))
    return damaged


def delete_objects(store: Store, keys: list[str]) -> None:
    """Remove ``keys`` (``kvcodec verify --delete``: vLLM recomputes them on the next miss)."""
    for key in keys:
        store.delete(key)


def _objects(store: Store, summary: StoreSummary | None = None) -> Iterator[tuple[str, bytes]]:
    """Every chunk object; block refs are counted in ``summary`` and skipped (they have no chunk header)."""
    for key in connector_keys(store):
        blob = store.get(key)
        if is_ref_key(key):
            if summary is not None and blob is not None:
                summary.refs += 1
                summary.ref_bytes += len(blob)
            continue
        if blob is not None:  # deleted or evicted since it was listed
            yield key, blob
