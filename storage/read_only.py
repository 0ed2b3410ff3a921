"""A store opened read-only: reads pass through, writes raise.

Why: inspection commands (``kvcodec inspect``, ``kvcodec verify``) must not
change what they look at. :func:`storage.open_store` with ``read_only=True``
wraps whatever it opened in :class:`ReadOnlyStore`, and backends that would
otherwise create something on open (the file store's directory) are told not
to.
"""

from __future__ import annotations

from collections.abc import Iterator

from storage.base import Store
from storage.errors import StoreError
from storage.ranged import RangedValue


class ReadOnlyError(StoreError):
    """A write to a store opened read-only."""


class ReadOnlyStore(Store):
    def __init__(self, inner: Store) -> None:
        super().__init__(inner.url)
        self.inner = inner

    @property
    def reads_in_memory(self) -> bool:
        return self.inner.reads_in_memory

    @property
    def ranged_reads(self) -> bool:
        return self.inner.ranged_reads

    def _get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def _open_ranged(self, key: str) -> RangedValue | None:
        return self.inner.open_ranged(key)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        return self.inner.get_many(keys)

    def _exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def _exists_many(self, keys: list[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    def _keys(self, prefix: str) -> Iterator[str]:
        return self.inner.keys(prefix)

    def _put(self, key: str, value: memoryview) -> None:
        raise ReadOnlyError(f"{self.url} was opened read-only; not writing {key!r}")

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        raise ReadOnlyError(f"{self.url} was opened read-only; not writing {key!r}")

    def _delete(self, key: str) -> None:
        raise ReadOnlyError(f"{self.url} was opened read-only; not deleting {key!r}")

    def _close(self) -> None:
        self.inner.close()
