"""Stores opened read-only (the inspection commands): nothing is created, nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import StoreUnavailableError, open_store
from storage.read_only import ReadOnlyError


def test_a_missing_file_store_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    root = tmp_path / "nowhere" / "store"
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        open_store(f"file://{root}", read_only=True)
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        open_store(f"faults+file://{root}?seed=1", read_only=True)  # a wrapper opens its inner store read-only too
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_reads_pass_and_writes_raise(tmp_path: Path, scheme: str) -> None:
    url = f"file://{tmp_path / 'store'}?max_bytes=1MiB" if scheme == "file" else "memory://read-only-test"
    with open_store(url) as store:
        store.put("kvc/a", b"x" * 10)
    before = sorted(p.name for p in (tmp_path / "store").rglob("*")) if scheme == "file" else []
    with open_store(url, read_only=True) as store:
        assert store.get("kvc/a") == b"x" * 10 and store.exists_many(["kvc/a", "kvc/b"]) == [True, False]
        assert list(store.keys("kvc/")) == ["kvc/a"]
        with pytest.raises(ReadOnlyError):
            store.put("kvc/b", b"y")
        with pytest.raises(ReadOnlyError):
            store.delete("kvc/a")
    if scheme == "file":
        assert sorted(p.name for p in (tmp_path / "store").rglob("*")) == before
