"""A stored value read in parts, straight into the reader's own buffers.

Why: a value that lies in a local file (the file store, on a local disk or in
the page cache) can be read with ``preadv`` directly where it is needed, such
as the KV pages a load writes, instead of into a new ``bytes`` that is then
copied there. For a 4096-token SmolLM2 prefix (94 MB) that is one copy instead
of two, and no fresh buffer to fault in. A reader first reads the value's head
(a chunk header), decides where the rest goes, then reads the rest there.

A store offers this with :attr:`Store.ranged_reads` and
:meth:`Store.open_ranged`; a store whose values arrive over a network (Redis,
Mooncake, a link emulator in front of a file store) does not, and readers use
``get``. Besides a file's values: :class:`BytesRange`, a value already in
memory, and :class:`CheckedRange`, a *sealed* value (a near tier's copy, whose
trailer digests its key and bytes) checked over the bytes as they are read.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

import xxhash

from storage.errors import StoreError, StoreUnavailableError

_T = TypeVar("_T")
#: At most this many buffers per ``preadv`` call (Linux's IOV_MAX is 1024).
MAX_BUFFERS = 1024


class RangedValue(abc.ABC):
    """One stored value, open for reads at offsets; the version opened stays readable until closed."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The value's length in bytes."""

    @abc.abstractmethod
    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``; a value shorter than that is a :class:`StoreError`."""

    @abc.abstractmethod
    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (writable, in order) with the bytes from ``offset`` on, each filled whole."""

    def close(self) -> None:
        """Release the file or connection behind the value."""

    def __enter__(self) -> RangedValue:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class FileRange(RangedValue):
    """A value at ``start`` of an open file, to its end; reads with ``pread``/``preadv`` (no file position shared)."""

    def __init__(self, fd: int, start: int, name: str) -> None:
        self._fd, self._start, self._name = fd, start, name
        self._size = os.fstat(fd).st_size - start
        if self._size < 0:
            raise StoreError(f"{name}: the value starts past the end of its file")

    @property
    def size(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        self._check_span(offset, length)
        data = self._io(lambda: os.pread(self._fd, length, self._start + offset))
        if len(data) != length:
            raise StoreError(f"{self._name}: short read ({len(data)} of {length} bytes at {offset}): truncated meanwhile?")
        return data

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        self._check_span(offset, sum(b.nbytes for b in buffers))
        for first in range(0, len(buffers), MAX_BUFFERS):
            part = buffers[first : first + MAX_BUFFERS]
            want = sum(b.nbytes for b in part)
            done = self._io(lambda: os.preadv(self._fd, part, self._start + offset))
            if done != want:  # a regular file returns all it has; less means it is shorter than it was
                raise StoreError(f"{self._name}: short read ({done} of {want} bytes at {offset}): truncated meanwhile?")
            offset += want

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_span(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self._size:
            raise StoreError(f"{self._name}: bytes [{offset}, {offset + length}) lie outside a {self._size}-byte value")

    def _io(self, op: Callable[[], _T]) -> _T:
        if self._fd < 0:
            raise StoreError(f"{self._name}: read after close")
        try:
            return op()
        except OSError as exc:
            raise StoreUnavailableError(f"{self._name}: read failed: {exc}") from exc


# ---- sealed values: a near tier's copies carry a trailer digest of their key and bytes ------------------------
#: Bytes of the trailer a sealed value ends with (an XXH3-64 of its key and its bytes).
TRAILER_BYTES = 8


def seal(key: str, value: memoryview | bytes) -> bytes:
    """``value`` with its trailer: the XXH3-64 of key and value, so a near copy checks itself and its key."""
    digest = xxhash.xxh3_64(key.encode("ascii") + b"\0")
    digest.update(value)
    return b"".join((value, digest.intdigest().to_bytes(TRAILER_BYTES, "little")))


def unseal(key: str, sealed: bytes) -> bytes | None:
    """The value inside a near copy, or None if the copy is damaged (wrong length, digest or key)."""
    if len(sealed) < TRAILER_BYTES:
        return None
    view = memoryview(sealed)
    digest = xxhash.xxh3_64(key.encode("ascii") + b"\0")
    digest.update(view[:-TRAILER_BYTES])
    if digest.intdigest() != int.from_bytes(view[-TRAILER_BYTES:], "little"):
        return None
    return view[:-TRAILER_BYTES].tobytes()


class CheckedRange(RangedValue):
    """A near copy read in parts: the trailer hidden, and checked over the bytes as the reader reads them.

    The reader reads the head, then the rest in order (possibly overlapping);
    the digest follows the first unread byte. When the last value byte has gone
    by and the digest differs, the copy is dropped and the read raises, so the
    caller fails this object (it is recomputed) and the next read goes far.
    """

    def __init__(self, inner: RangedValue, key: str, damaged: Callable[[str], None]) -> None:
        self._inner, self._key, self._damaged = inner, key, damaged
        self._size = inner.size - TRAILER_BYTES
        self._digest = xxhash.xxh3_64(key.encode("ascii") + b"\0")
        self._covered = 0

    @property
    def size(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        self._check_span(offset, length)
        data = self._inner.read(offset, length)
        self._follow(offset, [memoryview(data)])
        return data

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        self._check_span(offset, sum(b.nbytes for b in buffers))
        self._inner.read_into(offset, buffers)
        self._follow(offset, buffers)

    def close(self) -> None:
        self._inner.close()

    def _check_span(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self._size:
            raise StoreError(f"near copy of {self._key}: bytes [{offset}, {offset + length}) lie outside a "
                             f"{self._size}-byte value")

    def _follow(self, offset: int, parts: Sequence[memoryview]) -> None:
        """Hash the bytes past the covered prefix; at the end, compare with the trailer."""
        if offset > self._covered or self._covered == self._size:
            return  # a gap (the reader skipped ahead): this read cannot be checked, nor can the rest
        at = offset
        for part in parts:
            part = part.cast("B") if part.format != "B" or part.ndim != 1 else part
            end = at + part.nbytes
            if end > self._covered:
                self._digest.update(part[self._covered - at :])
                self._covered = end
            at = end
        if self._covered == self._size:
            stored = int.from_bytes(self._inner.read(self._size, TRAILER_BYTES), "little")
            if stored != self._digest.intdigest():
                self._damaged(self._key)
                raise StoreError(f"near copy of {self._key} is damaged (its trailer digest differs); dropped, "
                                 "the next read goes to the far store")


class BytesRange(RangedValue):
    """A value already in memory (read from the far store), offered through the ranged interface."""

    def __init__(self, blob: bytes) -> None:
        self._blob = memoryview(blob)

    @property
    def size(self) -> int:
        return self._blob.nbytes

    def read(self, offset: int, length: int) -> bytes:
        self._check_span(offset, length)
        return self._blob[offset : offset + length].tobytes()

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        self._check_span(offset, sum(b.nbytes for b in buffers))
        for b in buffers:
            b.cast("B")[:] = self._blob[offset : offset + b.nbytes]
            offset += b.nbytes

    def _check_span(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise StoreError(f"bytes [{offset}, {offset + length}) lie outside a {self.size}-byte value")
