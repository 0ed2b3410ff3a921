"""The stored value: LMCache's memory format plus one chunk-format blob per KV group.

Layout (little-endian)::

    b"LMKC" | u16 version | u32 meta_len | meta (ASCII JSON) | u64 XXH3-64(all before) | blob_0 | blob_1 ...

``meta`` is ``{"fmt": "<MemoryFormat name>", "sizes": [len(blob_0), ...]}``.
Each blob is a :func:`vllm_kvcodec.format.encode_chunk` chunk and carries its
own dtype, shape, codec and checksum, and is bound to its store key and group
(:func:`~vllm_kvcodec.lmcache_plugin.store_keys.group_binding`); the
envelope's own checksum covers the memory format and the sizes. Anything that does not parse exactly raises
:class:`~vllm_kvcodec.errors.ChunkFormatError`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import xxhash

from vllm_kvcodec.errors import ChunkFormatError

MAGIC = b"LMKC"
VERSION = 1
MAX_META_BYTES = 4096
MAX_GROUPS = 64
_HEAD = struct.Struct("<4sHI")
_SUM = struct.Struct("<Q")


def pack(fmt_name: str, blobs: Sequence[bytes]) -> bytes:
    if not 1 <= len(blobs) <= MAX_GROUPS:
        raise ValueError(f"{len(blobs)} KV groups; an object holds 1..{MAX_GROUPS}")
    meta = json.dumps({"fmt": fmt_name, "sizes": [len(b) for b in blobs]},
                      separators=(",", ":"), ensure_ascii=True).encode()
    if len(meta) > MAX_META_BYTES:
        raise ValueError("envelope metadata too large")
    head = _HEAD.pack(MAGIC, VERSION, len(meta)) + meta
    return b"".join((head, _SUM.pack(xxhash.xxh3_64_intdigest(head)), *blobs))


def unpack(value: bytes | bytearray | memoryview) -> tuple[str, list[memoryview]]:
    """``(memory format name, [chunk blob, ...])`` of a stored value, validated."""
    buf = memoryview(value).cast("B")
    if len(buf) < _HEAD.size + _SUM.size:
        raise ChunkFormatError(f"stored object of {len(buf)} bytes is too short for an LMCache envelope")
    magic, version, meta_len = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise ChunkFormatError(f"bad magic {bytes(magic)!r}: not a vllm-kvcodec LMCache object")
    if version != VERSION:
        raise ChunkFormatError(f"unsupported LMCache envelope version {version} (this reader knows {VERSION})")
    if meta_len > MAX_META_BYTES or _HEAD.size + meta_len + _SUM.size > len(buf):
        raise ChunkFormatError(f"envelope metadata length {meta_len} does not fit the object")
    end = _HEAD.size + meta_len
    (stored,) = _SUM.unpack_from(buf, end)
    if xxhash.xxh3_64_intdigest(buf[:end]) != stored:
        raise ChunkFormatError("envelope checksum mismatch: the object is corrupted")
    try:
        meta = json.loads(bytes(buf[_HEAD.size:end]).decode("ascii"))
        fmt, sizes = meta["fmt"], meta["sizes"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ChunkFormatError("envelope metadata is not the expected JSON") from None
    if not isinstance(fmt, str) or not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_GROUPS:
        raise ChunkFormatError("envelope metadata has a bad format name or group list")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise ChunkFormatError("envelope group sizes must be positive integers")
    at = end + _SUM.size
    if at + sum(sizes) != len(buf):
        raise ChunkFormatError(f"envelope sizes say {at + sum(sizes)} bytes, the object has {len(buf)}")
    blobs = []
    for size in sizes:
        blobs.append(buf[at:at + size])
        at += size
    return fmt, blobs
