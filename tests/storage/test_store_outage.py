"""A store that is down: the engine's store handle opens late, fails fast while down, and recovers by itself."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from storage import StoreUnavailableError, StoreURLError, open_store
from storage.testing.faults import find_fault_injector
from storage.outage import OutageGuard, StoreDownError
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import StoreRequiredError
from vllm_kvcodec.connector.store_access import open_connector_store


def closed_port() -> int:
    """A port nobody listens on, and no other test run on this machine is handed meanwhile."""
    from storage.testing.ports import reserved_port

    return reserved_port()


def test_down_store_fails_fast_then_recovers_without_a_restart() -> None:
    guard = OutageGuard("faults+memory://?down=1", open_store, retry_s=0.3)
    faults = find_fault_injector(guard)
    with pytest.raises(StoreUnavailableError, match="fault injection"):
        guard.put("a/b", b"1")
    assert guard.is_down and guard.outages == 1
    for _ in range(100):  # while down, nothing reaches the store
        with pytest.raises(StoreDownError, match="next try in"):
            guard.exists("a/b")
    assert faults.counts()["down"] == 1
    faults.up()
    time.sleep(0.35)
    assert not guard.is_down
    guard.put("a/b", b"1")
    assert guard.get("a/b") == b"1" and guard.outages == 1


def test_a_store_still_down_after_the_wait_is_tried_once_more_then_skipped_again() -> None:
    guard = OutageGuard("faults+memory://?down=1", open_store, retry_s=0.2)
    faults = find_fault_injector(guard)
    with pytest.raises(StoreUnavailableError):
        guard.get("a/b")
    time.sleep(0.25)
    with pytest.raises(StoreUnavailableError, match="fault injection"):
        guard.get("a/b")  # tried again
    with pytest.raises(StoreDownError):
        guard.get("a/b")  # and skipped again
    assert faults.counts()["down"] == 2 and guard.outages == 1


def test_store_that_cannot_be_opened_is_opened_once_it_can(tmp_path: Path) -> None:
    blocker = tmp_path / "mnt"
    blocker.write_text("not a directory yet")
    url = f"file://{blocker}/kv"
    with pytest.raises(StoreUnavailableError):
        open_store(url)
    guard = OutageGuard(url, open_store, retry_s=0.1)
    assert guard.inner is None and guard.is_down
    with pytest.raises(StoreDownError):
        guard.exists("a/b")
    blocker.unlink()
    blocker.mkdir()
    time.sleep(0.15)
    guard.put("a/b", b"x")
    assert open_store(url).get("a/b") == b"x"


def test_bad_url_still_fails_at_once() -> None:
    with pytest.raises(StoreURLError):
        OutageGuard("file://host/path", open_store)


def test_unreachable_redis_costs_one_refusal_per_retry_interval() -> None:
    config = ConnectorConfig(store=f"redis://127.0.0.1:{closed_port()}/0", store_retry_s=30)
    started = time.monotonic()
    store = open_connector_store(config)  # starts, though nothing listens
    assert store.is_down and "127.0.0.1" in store.reason
    for _ in range(1000):
        with pytest.raises(StoreDownError):
            store.exists_many(["a/b", "a/c"])
    assert time.monotonic() - started < 5


def test_required_store_that_is_unreachable_stops_start_up_clearly() -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    with pytest.raises(StoreRequiredError, match="cannot be reached at start-up and require_store_at_startup is set"):
        open_connector_store(ConnectorConfig(store=url, require_store_at_startup=True))
    store = open_connector_store(ConnectorConfig(store="memory://", require_store_at_startup=True))
    assert not store.is_down
