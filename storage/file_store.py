"""``file:///path`` — the embedded default store: a directory, no server.

Layout: ``<root>/ab/cd/<32 hex>``, the hex being a BLAKE2b-128 hash of the key.
Two levels of 256 directories keep every directory small at millions of
objects, and a fixed-length hashed name fits any filesystem whatever the key
(keys may be 512 characters, file names only 255 bytes). Each object file
starts with a small header holding its key, so :meth:`keys` can list the
original keys and a read can tell its object from a hash collision.

Why this is safe for several processes on one host: a put writes a uniquely
named temp file beside the target and ``os.replace``-s it into place, which is
atomic, so a reader sees the old whole value or the new whole value, never a
mix, and concurrent writers of one key leave one of their values whole. A reader
that already opened a file keeps reading that version even if it is replaced or
evicted meanwhile.

Options (URL query): ``max_bytes`` caps the total size (``10GiB``, ``500MB``,
``1e9``) with least-recently-used eviction (see :mod:`storage.file_cap`);
``fsync=1`` makes puts durable across power loss at the cost of a flush each.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import secrets
import struct
import threading
from collections.abc import Iterator
from typing import BinaryIO

from urllib.parse import unquote, urlsplit

from storage.base import Store
from storage.errors import StoreError, StoreUnavailableError, StoreURLError
from storage.file_cap import SizeCap, object_files, stamp, unlink_quietly
from storage.options import parse_bool, parse_size, reject_unknown, split_query
from storage.ranged import FileRange, RangedValue

_MAGIC = b"KVS1"
_HEADER = struct.Struct("<4sH")  # magic, key length; then the key, then the value


def from_url(url: str, read_only: bool = False) -> "FileStore":
    """``file:///abs/path[?max_bytes=10GiB&fsync=1]`` (also ``file:relative/path``); ``read_only``: see FileStore."""
    path, max_bytes, fsync = _settings(url)
    return FileStore(path, max_bytes=max_bytes, fsync=fsync, read_only=read_only)


def check_url(url: str) -> None:
    """Refuse what :func:`from_url` would refuse, without touching the filesystem."""
    _settings(url)


def _settings(url: str) -> tuple[str, int | None, bool]:
    """The directory, ``max_bytes`` and ``fsync`` a file URL names."""
    path, options = _parse_url(url)
    max_bytes = parse_size("max_bytes", options["max_bytes"]) if "max_bytes" in options else None
    return path, max_bytes, parse_bool("fsync", options.get("fsync", "0"))


def reads_in_memory_at(url: str) -> bool:
    """What :attr:`FileStore.reads_in_memory` of a store opened from ``url`` says, without opening it."""
    return not on_network_filesystem(os.path.abspath(_parse_url(url)[0]))


def _parse_url(url: str) -> tuple[str, dict[str, str]]:
    """The directory a file URL names, and its options (unknown ones refused)."""
    base, options = split_query(url)
    reject_unknown(options, {"max_bytes", "fsync"}, url)
    parts = urlsplit(base)
    if parts.netloc not in ("", "localhost"):
        raise StoreURLError(f"file URLs name a local path (file:///abs/path), not host {parts.netloc!r}: for the "
                            f"directory /{parts.netloc}{parts.path} write file:///{parts.netloc}{parts.path}")
    path = unquote(parts.path)
    if not path:
        raise StoreURLError(f"{url!r} names no directory")
    return path, options


def object_name(key: str) -> str:
    """A stable file name for ``key``: same on every host and Python version."""
    return hashlib.blake2b(key.encode("ascii"), digest_size=16).hexdigest()


class FileStore(Store):
    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None, fsync: bool = False,
                 read_only: bool = False) -> None:
        """``read_only``: the directory must exist (it is not created) and the size cap's index is not built
        (it writes); writes are refused by the :class:`~storage.read_only.ReadOnlyStore` around it."""
        self._root = os.path.abspath(os.fspath(root))
        super().__init__(_describe(self._root, max_bytes, fsync))
        self._fsync = fsync
        if read_only:
            if not os.path.isdir(self._root):
                raise StoreUnavailableError(f"no file store at {self._root}: the directory does not exist")
            self._cap = None
            return
        try:
            os.makedirs(self._root, exist_ok=True)
            self._cap = SizeCap(self._root, max_bytes) if max_bytes else None
        except OSError as exc:
            raise StoreUnavailableError(f"cannot open file store at {self._root}: {exc}") from exc

    @property
    def root(self) -> str:
        return self._root

    @property
    def reads_in_memory(self) -> bool:
        """A local file system: reads are copies out of the page cache (a network file system's wait on it)."""
        return not on_network_filesystem(self._root)

    def _path(self, key: str) -> str:
        name = object_name(key)
        return os.path.join(self._root, name[:2], name[2:4], name)

    def _get(self, key: str) -> bytes | None:
        try:
            # Unbuffered, so the value is read straight into the returned bytes (one copy).
            with open(self._path(key), "rb", buffering=0) as f:
                value = _read_object(f, key)
                if value is not None and self._cap:
                    stamp(f.fileno())
                return value
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(f"file store read of {key!r} failed: {exc}") from exc

    @property
    def ranged_reads(self) -> bool:
        """Values are local files: a reader can ``preadv`` them straight into its own buffers."""
        return True

    def _open_ranged(self, key: str) -> RangedValue | None:
        """The value as a :class:`FileRange` of its object file (the version open now, even if replaced later)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailableError(f"file store read of {key!r} failed: {exc}") from exc
        try:
            expected = _header(key)
            head = os.pread(fd, len(expected), 0)  # the header this key's object starts with, in one read
            if head != expected:
                if head[: len(_MAGIC)] != _MAGIC:
                    raise StoreError(f"file store object {path!r} has no valid header (not written by this store?)")
                os.close(fd)
                return None  # another key's object: a hash collision
            if self._cap:
                stamp(fd)
            return FileRange(fd, len(expected), path)
        except OSError as exc:
            os.close(fd)
            raise StoreUnavailableError(f"file store read of {key!r} failed: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise

    def _put(self, key: str, value: memoryview) -> None:
        self._write(key, value)

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        """Compared with the object file in place, written only if that file is still the one in place.

        Not atomic: the file compared is held open (its inode cannot be
        reused) and the new one renamed into place only if the path still
        names it, but a put renamed into place between that check (one
        ``stat``) and this rename is overwritten. A put during the
        comparison is seen.
        """
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                if _read_object(f, key) != expected:
                    return False
                return self._write(key, value, unless_replaced=os.fstat(f.fileno()))
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreUnavailableError(f"file store read of {key!r} failed: {exc}") from exc

    def _write(self, key: str, value: memoryview, unless_replaced: os.stat_result | None = None) -> bool:
        """Write a temp file and rename it into place; with ``unless_replaced``, only if the path still names that
        file (else False, nothing written)."""
        header = _header(key)
        size = len(header) + value.nbytes
        if self._cap and size > self._cap.max_bytes:
            raise StoreError(f"a {size}-byte object cannot fit a file store capped at {self._cap.max_bytes} bytes")
        path = self._path(key)
        tmp = _temp_name(path)
        try:
            self._write_temp(tmp, header, value)
            if unless_replaced is not None and not _names(path, unless_replaced):
                unlink_quietly(tmp)
                return False
            self._publish(tmp, path, size)
        except OSError as exc:
            unlink_quietly(tmp)
            raise StoreUnavailableError(f"file store write of {key!r} failed: {exc}") from exc
        return True

    def _write_temp(self, tmp: str, header: bytes, value: memoryview) -> None:
        try:
            f = open(tmp, "xb")
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            f = open(tmp, "xb")
        with f:
            f.write(header)
            f.write(value)
            f.flush()
            if self._cap:
                stamp(f.fileno())
            if self._fsync:
                os.fsync(f.fileno())

    def _publish(self, tmp: str, path: str, size: int) -> None:
        if self._cap:
            self._cap.publish(tmp, path, size)
        else:
            os.replace(tmp, path)
        if self._fsync:
            _fsync_dir(os.path.dirname(path))

    def _exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def _delete(self, key: str) -> None:
        try:
            if self._cap:
                self._cap.remove(self._path(key))
            else:
                unlink_quietly(self._path(key))
        except OSError as exc:
            raise StoreUnavailableError(f"file store delete of {key!r} failed: {exc}") from exc

    def _keys(self, prefix: str) -> Iterator[str]:
        try:
            for entry in object_files(self._root):
                key = _read_key(entry.path)
                if key is not None and key.startswith(prefix):
                    yield key
        except OSError as exc:
            raise StoreUnavailableError(f"file store listing of {self._root} failed: {exc}") from exc

    def _close(self) -> None:
        if self._cap:
            self._cap.close()


def _header(key: str) -> bytes:
    raw = key.encode("ascii")
    return _HEADER.pack(_MAGIC, len(raw)) + raw


#: File system types (``/proc/self/mounts``) whose reads go over a network.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
                       "9p", "afs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.glusterfs")


@functools.lru_cache(maxsize=64)
def on_network_filesystem(path: str) -> bool:
    """Whether ``path`` lies on a network file system (by ``/proc/self/mounts``; elsewhere: assumed local)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            return filesystem_type(os.path.realpath(path), f.read()) in NETWORK_FILESYSTEMS
    except OSError:
        return False


def filesystem_type(path: str, mounts: str) -> str:
    """The type of the file system ``path`` (absolute, resolved) is on: its longest mount point in ``mounts``."""
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")  # /proc/mounts writes a space as \040
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def _read_object(f: io.FileIO, key: str) -> bytes | None:
    """The value after the header, or None if the file holds another key (a hash collision)."""
    stored = _read_header(f)
    if stored is None:
        raise StoreError(f"file store object {f.name!r} has no valid header (not written by this store?)")
    return f.readall() if stored == key else None


def _read_header(f: io.FileIO | BinaryIO) -> str | None:
    head = f.read(_HEADER.size)
    if len(head) != _HEADER.size:
        return None
    magic, length = _HEADER.unpack(head)
    raw = f.read(length)
    if magic != _MAGIC or len(raw) != length or not raw.isascii():
        return None
    return raw.decode("ascii")


def _read_key(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return _read_header(f)
    except FileNotFoundError:  # deleted or evicted while listing
        return None


def _names(path: str, seen: os.stat_result) -> bool:
    """Whether ``path`` still names the file ``seen`` was taken of (kept open by the caller, so never reused)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino)


def _temp_name(path: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(root: str, max_bytes: int | None, fsync: bool) -> str:
    options = [f"max_bytes={max_bytes}"] if max_bytes else []
    options += ["fsync=1"] if fsync else []
    return f"file://{root}" + ("?" + "&".join(options) if options else "")
