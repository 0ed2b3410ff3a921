"""``memory://`` — a dict under a lock, for unit tests and single-process demos.

``memory://`` opens a fresh private store; ``memory://name`` opens a store shared
by every handle with that name in this process, so a test can hand a URL to code
that opens its own store and still look at what it wrote. Nothing crosses a
process boundary.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from urllib.parse import unquote, urlsplit

from storage.base import Store
from storage.options import reject_unknown, split_query

_SHARED: dict[str, tuple[dict[str, bytes], threading.Lock]] = {}
_SHARED_LOCK = threading.Lock()


def from_url(url: str) -> "MemoryStore":
    """``memory://`` (private) or ``memory://name`` (shared within the process)."""
    return MemoryStore(_name(url))


def check_url(url: str) -> None:
    """Refuse what :func:`from_url` would refuse (a memory store takes no options)."""
    _name(url)


def _name(url: str) -> str:
    base, options = split_query(url)
    reject_unknown(options, set(), url)
    parts = urlsplit(base)
    return unquote(parts.netloc + parts.path)


def _shared_map(name: str) -> tuple[dict[str, bytes], threading.Lock]:
    with _SHARED_LOCK:
        if name not in _SHARED:
            _SHARED[name] = ({}, threading.Lock())
        return _SHARED[name]


class MemoryStore(Store):
    """Values are copied into immutable ``bytes`` on put, so callers may reuse their buffers."""

    def __init__(self, name: str = "") -> None:
        super().__init__(f"memory://{name}")
        self._data, self._lock = _shared_map(name) if name else ({}, threading.Lock())

    @property
    def reads_in_memory(self) -> bool:
        return True

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def _put(self, key: str, value: memoryview) -> None:
        blob = value.tobytes()
        with self._lock:
            self._data[key] = blob

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        """Compared and written under the store's lock: atomic."""
        blob = value.tobytes()
        with self._lock:
            if self._data.get(key) != expected:
                return False
            self._data[key] = blob
            return True

    def _exists(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def _delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def _keys(self, prefix: str) -> Iterator[str]:
        with self._lock:
            snapshot = [k for k in self._data if k.startswith(prefix)]
        return iter(snapshot)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            return [self._data.get(k) for k in keys]

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        blobs = [(k, v.tobytes()) for k, v in items]
        with self._lock:
            self._data.update(blobs)
