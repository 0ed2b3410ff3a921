"""Ranged reads: a file store's value opened and read in parts, straight into the reader's buffers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage import StoreError, open_store
from storage.file_store import FileStore
from storage.outage import OutageGuard, StoreDownError

VALUE = bytes(range(256)) * 64


def _store(tmp_path: Path) -> FileStore:
    store = open_store(f"file://{tmp_path}/s")
    assert isinstance(store, FileStore)
    return store


def test_parts_read_into_buffers_equal_the_value(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("kv/a", VALUE)
    with store.open_ranged("kv/a") as value:
        assert value.size == len(VALUE)
        assert value.read(10, 20) == VALUE[10:30]
        parts = [bytearray(100), bytearray(1), bytearray(4000)]
        value.read_into(7, [memoryview(p) for p in parts])
        assert b"".join(parts) == VALUE[7:4108]
        value.read_into(0, [])  # nothing asked, nothing read


def test_missing_keys_and_reads_past_the_value(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.open_ranged("kv/none") is None
    store.put("kv/a", VALUE)
    with store.open_ranged("kv/a") as value:
        with pytest.raises(StoreError, match="outside"):
            value.read(len(VALUE) - 4, 5)
        with pytest.raises(StoreError, match="outside"):
            value.read_into(len(VALUE) - 4, [memoryview(bytearray(5))])
    with pytest.raises(StoreError, match="after close"):
        value.read(0, 1)


def test_an_open_value_keeps_its_version_when_replaced_or_deleted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("kv/a", VALUE)
    with store.open_ranged("kv/a") as value:
        store.put("kv/a", b"new")
        store.delete("kv/a")
        assert value.read(0, len(VALUE)) == VALUE


def test_a_file_truncated_under_an_open_value_is_a_short_read(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("kv/a", VALUE)
    path = store._path("kv/a")
    with store.open_ranged("kv/a") as value:
        os.truncate(path, os.path.getsize(path) - 100)  # in place: not how this store writes, but a disk may
        with pytest.raises(StoreError, match="short read"):
            value.read_into(0, [memoryview(bytearray(len(VALUE)))])


def test_a_file_of_another_key_is_not_opened(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("kv/a", VALUE)
    os.makedirs(os.path.dirname(store._path("kv/b")), exist_ok=True)
    os.replace(store._path("kv/a"), store._path("kv/b"))  # what a hash collision looks like on disk
    assert store.open_ranged("kv/b") is None


def test_which_stores_read_in_ranges(tmp_path: Path) -> None:
    """Local files do; a store reached over a network (or emulating one) or changing what is read does not."""
    assert _store(tmp_path).ranged_reads
    assert open_store(f"file://{tmp_path}/s", read_only=True).ranged_reads  # the wrapper answers for it
    assert not open_store("memory://").ranged_reads
    assert not open_store(f"link+file://{tmp_path}/s?gbps=10").ranged_reads
    assert not open_store(f"faults+file://{tmp_path}/s?seed=1").ranged_reads
    with pytest.raises(StoreError, match="does not read values in parts"):
        open_store("memory://").open_ranged("kv/a")


def test_the_outage_guard_passes_ranged_reads_through_and_still_guards_them(tmp_path: Path) -> None:
    _store(tmp_path).put("kv/a", VALUE)
    guard = OutageGuard(f"file://{tmp_path}/s", open_store, retry_s=60)
    guard.probe()
    assert guard.ranged_reads
    with guard.open_ranged("kv/a") as value:
        assert value.read(0, 4) == VALUE[:4]
    guard._failed(StoreDownError("down for the test"))
    with pytest.raises(StoreDownError):
        guard.open_ranged("kv/a")
