"""The 16-byte trailer on every object the Mooncake store writes, and its check on every read.

Why a check of our own on top of Mooncake's promise that a get returns complete
data. That promise rests on the read lease: the master grants one with every
lookup, eviction skips leased objects, and the client discards a read whose
lease ran out before its transfer finished. Two things we rely on sit outside it:

- ``delete`` removes with ``force`` (a reader's lease would otherwise refuse the
  delete for the lease TTL, 10 s by default), which frees the object's slot at
  once; a reader between its lookup and its transfer may then read whatever the
  next put writes into that slot;
- Mooncake refuses empty objects, so a zero-byte value needs some framing anyway.

So each object is ``value || magic || XXH3-64(value, seed=XXH3-64(key))``. A read
whose trailer does not match is a miss: torn bytes, bytes of another key and
objects some other program wrote under our prefix are never returned as values.
The digest runs at ~10 GB/s; a transfer over loopback TCP at ~1 GB/s.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"kvcMC\x00\x00\x01"  # kvcodec, Mooncake frame, version 1
TRAILER = struct.Struct("<8sQ")
TRAILER_SIZE = TRAILER.size


def _digest(key: str, value: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(value, seed=xxhash.xxh3_64_intdigest(key.encode("ascii")))


def trailer(key: str, value: memoryview) -> bytes:
    """The bytes to store right after ``value`` under ``key`` (the full key, tenant prefix included)."""
    return TRAILER.pack(MAGIC, _digest(key, value))


def unframe(key: str, stored: memoryview) -> memoryview | None:
    """The value inside ``stored`` (a view, no copy), or None when the trailer does not vouch for it."""
    if stored.nbytes < TRAILER_SIZE:
        return None
    value = stored[: stored.nbytes - TRAILER_SIZE]
    magic, digest = TRAILER.unpack_from(stored, value.nbytes)
    if magic != MAGIC or digest != _digest(key, value):
        return None
    return value
