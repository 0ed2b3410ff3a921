"""The bytes a kvcodec serde writes into LMCache's serialized buffer: a short frame around one chunk per KV group.

Layout (little-endian)::

    b"KVMP" | u16 version | u16 groups | u64 body_len | u64 size_0 .. size_{groups-1} | u64 XXH3-64(all before) | blob_0 ..

Each blob is a :mod:`vllm_kvcodec.format` chunk (its own dtype, shape, codec,
checksum and key binding). The frame is self-delimiting: LMCache hands a
deserializer a buffer sized by the serde's *estimate*, and whatever follows the
frame (padding, or stale bytes of a recycled buffer) is never read. The magic
lets a reader name an object that some other serde, or no serde, wrote.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from vllm_kvcodec.errors import ChunkFormatError

MAGIC = b"KVMP"
VERSION = 1
MAX_GROUPS = 64
_HEAD = struct.Struct("<4sHHQ")
_SIZE = struct.Struct("<Q")
_SUM = struct.Struct("<Q")


def frame_overhead(groups: int) -> int:
    """Bytes the frame adds around ``groups`` chunk blobs."""
    return _HEAD.size + _SIZE.size * groups + _SUM.size


def pack(blobs: Sequence[bytes]) -> list[bytes]:
    """The frame as parts to write in order (head, then the blobs): no joined copy of the chunks."""
    if not 1 <= len(blobs) <= MAX_GROUPS:
        raise ValueError(f"{len(blobs)} KV groups; a serialized object holds 1..{MAX_GROUPS}")
    sizes = [len(b) for b in blobs]
    head = _HEAD.pack(MAGIC, VERSION, len(blobs), sum(sizes)) + b"".join(_SIZE.pack(s) for s in sizes)
    return [head + _SUM.pack(xxhash.xxh3_64_intdigest(head)), *blobs]


def is_frame(buf: bytes | bytearray | memoryview) -> bool:
    """Whether ``buf`` starts like a kvcodec serde frame (cheap; :func:`unpack` validates)."""
    return bytes(memoryview(buf)[: len(MAGIC)]) == MAGIC


def unpack(buf: bytes | bytearray | memoryview) -> list[memoryview]:
    """The chunk blobs of the frame at the start of ``buf`` (which may be longer), validated before any slicing."""
    view = memoryview(buf).cast("B")
    if len(view) < _HEAD.size + _SIZE.size + _SUM.size:
        raise ChunkFormatError(f"{len(view)} bytes are too short for a kvcodec serde object")
    magic, version, groups, body_len = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ChunkFormatError(
            f"not written by a kvcodec serde (magic {bytes(magic)!r}): the object was stored without a serde "
            "or by another serde (fp8, aesgcm, ...); point this adapter's serde back at what wrote it"
        )
    if version != VERSION:
        raise ChunkFormatError(f"kvcodec serde frame version {version}; this reader knows {VERSION}")
    if not 1 <= groups <= MAX_GROUPS:
        raise ChunkFormatError(f"kvcodec serde frame says {groups} KV groups (1..{MAX_GROUPS})")
    head_len = _HEAD.size + _SIZE.size * groups
    if head_len + _SUM.size > len(view):
        raise ChunkFormatError("kvcodec serde frame header runs past the buffer")
    (stored,) = _SUM.unpack_from(view, head_len)
    if xxhash.xxh3_64_intdigest(view[:head_len]) != stored:
        raise ChunkFormatError("kvcodec serde frame header checksum mismatch: the object is corrupted")
    sizes = [_SIZE.unpack_from(view, _HEAD.size + _SIZE.size * i)[0] for i in range(groups)]
    at = head_len + _SUM.size
    if sum(sizes) != body_len or at + body_len > len(view):
        raise ChunkFormatError(f"kvcodec serde frame of {at + body_len} bytes does not fit the {len(view)} read")
    blobs = []
    for size in sizes:
        blobs.append(view[at : at + size])
        at += size
    return blobs
