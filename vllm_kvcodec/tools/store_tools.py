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
from vllm_kvcodec.keys.block_refs import is_ref_key
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import ChunkHeader, decode_payload, read_header
from vllm_kvcodec.keys.chain import KEY_PREFIX


@dataclasses.dataclass
class StoreSummary:
    objects: int = 0  # chunk objects read, damaged ones included
    read_bytes: int = 0  # their bytes
    stored_bytes: int = 0  # the sound ones' bytes
    raw_bytes: int = 0
    damaged_objects: list = dataclasses.field(default_factory=list)  # (key, reason)
    refs: int = 0  # block refs (keys/block_refs.py): tiny index entries, not chunk objects
    ref_bytes: int = 0
    namespaces: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    codecs: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # sound objects per codec
    codec_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    chunks: set = dataclasses.field(default_factory=set)

    @property
    def damaged(self) -> int:
        return len(self.damaged_objects)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0


def connector_keys(store: Store) -> Iterator[str]:
    return store.keys(f"{KEY_PREFIX}/")


def inspect_store(store: Store, progress: Callable[[], None] = lambda: None) -> StoreSummary:
    """Namespaces, chunks, bytes stored vs raw and codecs, from headers (checksums verified)."""
    return _survey(store, read_header, progress)


def verify_store(store: Store, progress: Callable[[], None] = lambda: None) -> StoreSummary:
    """What :func:`inspect_store` counts, each object decoded whole; its ``damaged_objects`` say which failed and
    why (the store may be read-only: nothing is changed)."""
    return _survey(store, _decoded, progress)


def _decoded(blob: bytes) -> ChunkHeader:
    """The header of ``blob``, after its checksum, header and codec payload all passed (ChunkFormatError if not)."""
    header = read_header(blob)
    decode_payload(blob, header)
    return header


def _survey(store: Store, check: Callable[[bytes], ChunkHeader], progress: Callable[[], None]) -> StoreSummary:
    """Every chunk object ``check``-ed and counted; a ChunkFormatError makes it damaged."""
    summary = StoreSummary()
    for key, blob in _objects(store, summary):
        progress()
        summary.objects += 1
        summary.read_bytes += len(blob)
        parts = key.split("/")
        summary.chunks.add("/".join(parts[1:3]))
        try:
            header = check(blob)
        except ChunkFormatError as exc:
            summary.damaged_objects.append((key, str(exc)))
            continue
        summary.stored_bytes += len(blob)
        summary.raw_bytes += header.raw_nbytes
        summary.namespaces[parts[1] if len(parts) > 2 else "?"] += 1
        summary.codecs[header.codec_id] += 1
        summary.codec_bytes[header.codec_id] += len(blob)
    return summary


def verify_report(summary: StoreSummary) -> list[str]:
    """What ``kvcodec verify`` checked and found, one line each; the last counts the damaged objects."""
    if not summary.objects:
        refs = f" ({summary.refs} block ref(s) only)" if summary.refs else ""
        return [f"the store is empty: no chunk objects under {KEY_PREFIX}/{refs}; nothing was checked"]
    lines = [f"checked {summary.objects} object(s) of {len(summary.chunks)} chunk(s), {summary.read_bytes:,} bytes: "
             "checksum, header and codec payload of each"]
    by_count = sorted(summary.codecs.items(), key=lambda item: (-item[1], item[0]))
    if by_count:
        lines.append("sound, per codec: " + ", ".join(f"{c} {n} ({summary.codec_bytes[c]:,} bytes)" for c, n in by_count))
    if summary.refs:
        lines.append(f"skipped {summary.refs} block ref(s) ({summary.ref_bytes:,} bytes): index entries, not chunks")
    return [*lines, f"{summary.damaged} damaged object(s)"]


def delete_objects(store: Store, keys: list[str]) -> None:
    """Remove ``keys`` (``kvcodec verify --delete``: vLLM recomputes them on the next miss)."""
    for key in keys:
        store.delete(key)


def _objects(store: Store, summary: StoreSummary) -> Iterator[tuple[str, bytes]]:
    """Every chunk object; block refs are counted in ``summary`` and skipped (they have no chunk header)."""
    for key in connector_keys(store):
        blob = store.get(key)
        if is_ref_key(key):
            if blob is not None:
                summary.refs += 1
                summary.ref_bytes += len(blob)
            continue
        if blob is not None:  # deleted or evicted since it was listed
            yield key, blob
