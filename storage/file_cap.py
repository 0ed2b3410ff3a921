"""The size cap of a file store: a usage counter shared by every process, and LRU eviction.

Why a counter file under ``flock`` rather than a per-process estimate: several
vLLM workers on one host write into the same directory, and per-process
estimates would let the directory grow to (workers x cap). Publishing an object
(``os.replace``), deleting one and evicting all happen under one lock on
``<root>/.usage``, which holds the byte total, so the total is exact no matter
how many processes and threads write, and overwrites of one key by two writers
are charged once.

Recency is the file's mtime: set on put and touched on every get, with
nanosecond timestamps from ``time.time_ns`` (filesystem clocks tick in
milliseconds, too coarse to order back-to-back operations). Eviction scans the
directory, which is O(objects), so it runs only when the total passes the cap,
and then removes the least recently used objects until the total is under
``low_water`` x cap; that amortises one scan over many puts. Each eviction also
re-measures the total, healing any drift (a writer killed between its rename
and its counter update, files removed by hand).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

#: Temp files older than this belong to a crashed writer and are removed by eviction scans.
STALE_TEMP_SECONDS = 3600.0


def object_files(root: str) -> Iterator[os.DirEntry[str]]:
    """Every object file under the two-level fan-out, skipping temp files (their names start with '.')."""
    return (e for e in fanout_entries(root) if not e.name.startswith("."))


def fanout_entries(root: str) -> Iterator[os.DirEntry[str]]:
    """Every plain file in the leaf directories of the fan-out."""
    for level1 in _subdirs(root):
        for level2 in _subdirs(level1.path):
            for entry in _scandir(level2.path):
                if entry.is_file(follow_symlinks=False):
                    yield entry


def _subdirs(path: str) -> Iterator[os.DirEntry[str]]:
    return (e for e in _scandir(path) if len(e.name) == 2 and e.is_dir(follow_symlinks=False))


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def stamp(fd: int) -> None:
    """Mark an object as just used; best effort, since a cache must not fail a read over it."""
    now = time.time_ns()
    with suppress(OSError):
        os.utime(fd, ns=(now, now))


class SizeCap:
    """Keeps the objects under ``root`` at or below ``max_bytes`` (file sizes, headers included)."""

    def __init__(self, root: str, max_bytes: int, low_water: float = 0.9) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._target = int(max_bytes * low_water)
        self.evicted = 0  # objects this handle evicted (a near tier's eviction counter)
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._fd = os.open(os.path.join(root, ".usage"), os.O_RDWR | os.O_CREAT, 0o644)
        with self._locked():
            if self._read_total() is None:
                self._evict()

    def close(self) -> None:
        os.close(self._fd)

    def publish(self, tmp: str, path: str, size: int) -> None:
        """Move a finished temp file into place and charge its size, evicting if over the cap."""
        with self._locked():
            old = _size_or_zero(path)
            os.replace(tmp, path)
            total = max(0, (self._read_total() or 0) + size - old)
            self._write_total(total)
            if total > self.max_bytes:
                self._evict()

    def remove(self, path: str) -> None:
        with self._locked():
            old = _size_or_zero(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            self._write_total(max(0, (self._read_total() or 0) - old))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read_total(self) -> int | None:
        raw = os.pread(self._fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def _write_total(self, total: int) -> None:
        os.pwrite(self._fd, total.to_bytes(8, "little"), 0)

    def _evict(self) -> None:
        """Re-measure the directory and drop least recently used objects down to the low-water mark."""
        objects = self._measure()
        total = sum(size for _, size, _ in objects)
        if total > self.max_bytes:
            objects.sort()
            for _, size, path in objects:
                if total <= self._target:
                    break
                unlink_quietly(path)
                total -= size
                self.evicted += 1
        self._write_total(total)

    def _measure(self) -> list[tuple[int, int, str]]:
        """(mtime, size, path) of every object; temp files of crashed writers are removed on the way."""
        objects = []
        horizon = time.time_ns() - int(STALE_TEMP_SECONDS * 1e9)
        for entry in fanout_entries(self.root):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not entry.name.startswith("."):
                objects.append((st.st_mtime_ns, st.st_size, entry.path))
            elif entry.name.endswith(".tmp") and st.st_mtime_ns < horizon:
                unlink_quietly(entry.path)
        return objects


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it is still there; another writer or evictor may have been first."""
    with suppress(FileNotFoundError):
        os.unlink(path)
