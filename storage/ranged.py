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
``get``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

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
