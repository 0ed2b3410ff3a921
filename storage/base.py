"""The one protocol every store speaks, and the rules every key obeys.

The public methods live here, once, so that key validation, value coercion and
the closed check behave identically on every backend; a backend only fills in
the underscored primitives. Batched forms default to a loop so a new backend
works on day one, and a backend that can do better (MGET, pipelines) overrides
the underscored batch primitive.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import TypeVar

from storage.errors import InvalidKeyError, StoreError, StoreUnavailableError
from storage.ranged import RangedValue

#: What ``put`` accepts: anything exposing a contiguous buffer of bytes.
Value = bytes | bytearray | memoryview

MAX_KEY_LENGTH = 512

_S = TypeVar("_S", bound="Store")


def validate_key(key: object) -> str:
    """Reject keys that could escape a directory, break a URL or differ by encoding.

    Keys are printable ASCII, 1..512 characters, ``/``-separated segments, none
    of them empty, ``.`` or ``..``, and no leading ``/``.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store keys are str, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("store key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"store key has {len(key)} characters, over the limit of {MAX_KEY_LENGTH}")
    if not (key.isascii() and key.isprintable()):
        raise InvalidKeyError(f"store key {key!r} is not printable ASCII")
    if key.startswith("/"):
        raise InvalidKeyError(f"store key {key!r} starts with '/'")
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise InvalidKeyError(f"store key {key!r} has an empty, '.' or '..' segment")
    return key


def validate_prefix(prefix: object) -> str:
    """A listing prefix may be empty or end in '/', but must still be printable ASCII."""
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"key prefixes are str, not {type(prefix).__name__}")
    if len(prefix) > MAX_KEY_LENGTH or not (prefix.isascii() and prefix.isprintable()):
        raise InvalidKeyError(f"key prefix {prefix!r} is not printable ASCII of at most {MAX_KEY_LENGTH} characters")
    return prefix


def as_buffer(value: object) -> memoryview:
    """A flat byte view of ``value`` without copying, so large chunks are not duplicated."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"store values are bytes, bytearray or memoryview, not {type(value).__name__}")
    view = memoryview(value)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Store(abc.ABC):
    """A flat map of ASCII keys to byte values, safe to share between threads.

    A missing key is ``None`` (never an exception); a store that cannot answer
    raises :class:`~storage.errors.StoreUnavailableError` within bounded time.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._closed = False

    @property
    def url(self) -> str:
        """The URL this store was opened from, with any password redacted."""
        return self._url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    @property
    def reads_in_memory(self) -> bool:
        """A read is a memory copy on this host (file in the page cache, memory), not a wait on a network.

        The fetcher then reads on no more threads than it decodes on: a read
        costs CPU like a decode, and extra readers only take cores from the
        engine. Wrappers answer for the store they wrap.
        """
        return False

    @property
    def ranged_reads(self) -> bool:
        """Values can be opened with :meth:`open_ranged` and read straight into the caller's buffers.

        Only a store whose values lie in local files says so; wrappers answer
        for the store they wrap, except those that change what is read (a link
        emulator, a fault injector), which read with ``get``.
        """
        return False

    @property
    def is_down(self) -> bool:
        """Known to be unreachable right now, without asking it (an outage guard knows; a plain store never claims it)."""
        return False

    # -- public protocol -------------------------------------------------

    def get(self, key: str) -> bytes | None:
        self._check_open()
        return self._get(validate_key(key))

    def open_ranged(self, key: str) -> RangedValue | None:
        """``key``'s value, open for reads in parts (close it after), or ``None`` if missing; see :mod:`storage.ranged`.

        Only where :attr:`ranged_reads` is true; elsewhere a :class:`StoreError`.
        """
        self._check_open()
        return self._open_ranged(validate_key(key))

    def put(self, key: str, value: Value) -> None:
        self._check_open()
        self._put(validate_key(key), as_buffer(value))

    def replace(self, key: str, expected: Value, value: Value) -> bool:
        """Write ``value`` under ``key`` only if ``key`` holds exactly ``expected`` now; True if it was written.

        For a writer whose value is made from what it read (the upgrader's
        re-encoding of a loaded object): a newer value written meanwhile is
        left as it is, and so is the key's absence (deleted, evicted). Atomic
        where the backend has a conditional write (memory, Redis); elsewhere
        a put landing between the comparison and the write is overwritten
        (see each backend's ``_replace``).
        """
        self._check_open()
        return self._replace(validate_key(key), as_buffer(expected), as_buffer(value))

    def exists(self, key: str) -> bool:
        self._check_open()
        return self._exists(validate_key(key))

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error (the goal state holds)."""
        self._check_open()
        self._delete(validate_key(key))

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """Values in the order of ``keys``, ``None`` where missing; one round trip where possible."""
        self._check_open()
        return self._get_many([validate_key(k) for k in keys])

    def put_many(self, items: Iterable[tuple[str, Value]]) -> None:
        self._check_open()
        self._put_many([(validate_key(k), as_buffer(v)) for k, v in items])

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        self._check_open()
        return self._exists_many([validate_key(k) for k in keys])

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Every stored key starting with ``prefix``, in no particular order.

        Meant for inspection tools, not the hot path: backends may scan.
        """
        self._check_open()
        return self._keys(validate_prefix(prefix))

    def close(self) -> None:
        """Release connections and files; later calls raise StoreUnavailableError."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- what a backend provides -----------------------------------------

    @abc.abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _put(self, key: str, value: memoryview) -> None: ...

    @abc.abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _keys(self, prefix: str) -> Iterator[str]: ...

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self._get(k) for k in keys]

    def _open_ranged(self, key: str) -> RangedValue | None:
        raise StoreError(f"{self!r} does not read values in parts; use get")

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        for key, value in items:
            self._put(key, value)

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        """Read, compare, write: not atomic. A put by another writer between the read and the write is lost (a
        backend with a conditional write overrides this)."""
        if self._get(key) != expected:
            return False
        self._put(key, value)
        return True

    def _exists_many(self, keys: list[str]) -> list[bool]:
        return [self._exists(k) for k in keys]

    def _close(self) -> None:
        """Backends with connections or descriptors override this."""

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"{self!r} is closed")
