"""Mooncake Store against a real pool: what Mooncake does on its own is a miss or a StoreUnavailableError, never wrong data.

Every value written here is self-verifying (length + xxhash64 header, see
tests/storage/test_stores.py) and every value read back is compared with what was
written, so a torn, stale-from-another-key or mixed read fails the test.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time

import pytest

from storage import StoreError, StoreUnavailableError, StoreURLError, check_url, open_store
from storage.mooncake_frame import trailer
from storage.mooncake_options import parse_mooncake_url
from storage.testing.mooncake_server import MooncakePool
from storage.outage import OutageGuard, StoreDownError
from tests.support.mooncake_server import short_lived_mooncake_pool
from tests.storage.test_stores import checked_value

pytestmark = pytest.mark.mooncake

MiB = 1 << 20


def write_checked(store, count: int, size: int, tag: str = "obj") -> dict[str, bytes]:
    values = {f"{tag}/{i}": checked_value(i, size) for i in range(count)}
    store.put_many(values.items())
    return values


def assert_exact_or_missing(store, values: dict[str, bytes]) -> list[str]:
    """Every value read equals the one written; returns the keys that were missing."""
    got = store.get_many(list(values))
    for (key, want), blob in zip(values.items(), got):
        if blob is not None:
            assert blob == want, f"{key}: a different value came back"
    return [key for key, blob in zip(values, got) if blob is None]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


# --------------------------------------------------------------------------- a pool of several nodes


def _write_and_exit(url: str) -> None:
    with open_store(url) as store:
        write_checked(store, 16, MiB)


def test_objects_outlive_their_writer_and_spread_over_both_nodes(mooncake_pool: MooncakePool, mooncake_url: str) -> None:
    writer = multiprocessing.get_context("spawn").Process(target=_write_and_exit, args=(mooncake_url,))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    expected = {f"obj/{i}": checked_value(i, MiB) for i in range(16)}
    with open_store(mooncake_url) as reader:
        assert assert_exact_or_missing(reader, expected) == []
        prefix = reader.prefix
    holders = {seg for key in expected for seg in mooncake_pool.replica_segments(prefix + key)}
    assert holders == set(mooncake_pool.segments.values()), "the pool's objects should live on both nodes"


def test_a_client_with_a_segment_is_one_more_node(mooncake_pool: MooncakePool, mooncake_url: str) -> None:
    before = mooncake_pool.live_segments()
    with open_store(mooncake_url + "&segment=32MiB") as node:
        assert len(mooncake_pool.live_segments() - before) == 1
        node.put("k", b"v")
    wait_until(lambda: mooncake_pool.live_segments() == before, 10, "the closed client's segment leaving")


# --------------------------------------------------------------------------- what Mooncake does on its own


def test_a_full_pool_evicts_and_later_reads_miss_cleanly() -> None:
    with short_lived_mooncake_pool(segment_bytes=32 * MiB) as pool, open_store(pool.url(buffer="16MiB")) as store:
        values = {}
        for round_ in range(6):  # 6 x 8 x 2 MiB = 96 MiB into a 64 MiB pool
            values.update(write_checked(store, 8, 2 * MiB, tag=f"r{round_}"))
        missing = assert_exact_or_missing(store, values)
        assert 0 < len(missing) < len(values), f"{len(missing)} of {len(values)} missing: expected eviction, not loss"


@pytest.mark.timeout(120)
def test_master_killed_mid_run_fails_fast_and_hits_resume_through_the_guard() -> None:
    with short_lived_mooncake_pool() as pool:
        guard = OutageGuard(pool.url(timeout_s=2, buffer="16MiB"), open_store, retry_s=2)
        old = write_checked(guard, 4, MiB, tag="old")
        failures: list[tuple[BaseException, float]] = []

        def traffic() -> None:
            try:
                while True:
                    assert_exact_or_missing(guard, write_checked(guard, 4, MiB, tag="live"))
            except StoreUnavailableError as exc:
                failures.append((exc, time.monotonic()))

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        time.sleep(0.5)
        killed_at = time.monotonic()
        pool.master.kill()
        thread.join(10)
        assert not thread.is_alive(), "a call hung after the master died"
        assert failures and failures[0][1] - killed_at < 4
        with pytest.raises(StoreDownError):
            guard.get("old/0")  # while down: at once, without asking the client
        pool.restart_master()
        wait_until(lambda: _answers(guard), 20, "the guard's store answering again")
        assert assert_exact_or_missing(guard, old) == list(old), "a new master knows none of the old objects"
        assert assert_exact_or_missing(guard, write_checked(guard, 4, MiB, tag="new")) == []
        guard.close()


def _answers(guard: OutageGuard) -> bool:
    try:
        guard.exists("probe")
        return True
    except StoreUnavailableError:
        return False


@pytest.mark.timeout(60)
def test_a_frozen_master_times_out_within_timeout_s_and_recovers() -> None:
    with short_lived_mooncake_pool() as pool, open_store(pool.url(timeout_s=1, buffer="16MiB")) as store:
        store.put("k", b"value")
        pool.master.freeze()
        try:
            for call in (lambda: store.get("k"), lambda: store.exists_many(["k"]), lambda: store.put("j", b"1")):
                started = time.monotonic()
                with pytest.raises(StoreUnavailableError, match="did not answer within 1 s"):
                    call()
                assert time.monotonic() - started < 2
        finally:
            pool.master.thaw()
        wait_until(lambda: store.get("k") == b"value", 20, "reads after the master thawed")


@pytest.mark.timeout(90)
def test_a_node_leaving_takes_only_its_own_objects() -> None:
    with short_lived_mooncake_pool(master_args=["--client_ttl=2"]) as pool:
        with open_store(pool.url(timeout_s=3, buffer="32MiB")) as store:
            values = write_checked(store, 16, MiB)
            home = {key: pool.replica_segments(store.prefix + key) for key in values}
            gone = pool.segments["node0"]
            assert sum(gone in segs for segs in home.values()) > 0, "no object landed on node0"
            pool.nodes[0].kill()
            try:  # before the master notices: whatever comes back is right, or nothing
                assert_exact_or_missing(store, values)
            except StoreUnavailableError:
                pass  # reads of the dead node timing out count as failures, not as data
            wait_until(lambda: gone not in pool.live_segments(), 30, "the master dropping node0's segment")
            missing = set(assert_exact_or_missing(store, values))
            assert missing == {key for key, segs in home.items() if gone in segs}


@pytest.mark.timeout(90)
def test_with_two_replicas_a_node_leaving_loses_nothing() -> None:
    with short_lived_mooncake_pool(master_args=["--client_ttl=2"]) as pool:
        with open_store(pool.url(replicas=2, timeout_s=3, buffer="32MiB")) as store:
            values = write_checked(store, 8, MiB)
            assert all(len(pool.replica_segments(store.prefix + key)) == 2 for key in values)
            pool.nodes[0].kill()
            wait_until(lambda: pool.segments["node0"] not in pool.live_segments(), 30, "node0 leaving")
            assert assert_exact_or_missing(store, values) == []


# --------------------------------------------------------------------------- the store's own checks


def test_objects_without_our_trailer_or_for_another_key_read_as_misses(mooncake_url: str) -> None:
    with open_store(mooncake_url) as store:
        client, prefix = store._client, store.prefix
        assert client.upsert(prefix + "foreign", b"written by some other program") == 0
        value = memoryview(b"the value of a")
        assert client.upsert_parts(prefix + "b", value, trailer(prefix + "a", value)) == 0  # a's frame under b
        assert client.upsert_parts(prefix + "a", value, trailer(prefix + "a", value)) == 0
        assert store.get_many(["foreign", "b", "a"]) == [None, None, b"the value of a"]


def test_an_object_larger_than_the_buffer_is_refused_clearly(mooncake_pool: MooncakePool) -> None:
    with open_store(mooncake_pool.url(prefix="buffer-test/", buffer="1MiB")) as store:
        with pytest.raises(StoreError, match="does not fit buffer=1048576"):
            store.put("big", bytes(2 * MiB))
        store.put_many([(f"small/{i}", bytes(300_000)) for i in range(8)])  # a batch larger than the buffer is split
        assert all(v == bytes(300_000) for v in store.get_many([f"small/{i}" for i in range(8)]))


def test_unreachable_master_fails_fast() -> None:
    from storage.testing.ports import reserved_port as _free_port

    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        open_store(f"mooncake://127.0.0.1:{_free_port()}?local_host=127.0.0.1")
    assert time.monotonic() - started < 2


def test_url_defaults_follow_mooncake_master() -> None:
    options = parse_mooncake_url("mooncake://10.0.0.5?local_host=10.0.0.9")
    assert options.master == "10.0.0.5:50051"
    assert options.metadata == "http://10.0.0.5:8080/metadata" and options.admin == "http://10.0.0.5:9003"
    assert options.segment == 0 and options.buffer == 256 * MiB and options.replicas == 1
    assert options.protocol == "tcp" and options.timeout_s == 5.0
    full = parse_mooncake_url(
        "mooncake://m:7000?metadata=etcd://e:2379&segment=4GiB&buffer=1GiB&replicas=2&protocol=rdma&device=mlx5_0"
        "&prefix=kvc/prod/&timeout_s=0.5&local_host=127.0.0.1"
    )
    assert (full.master, full.metadata, full.segment, full.buffer) == ("m:7000", "etcd://e:2379", 4 << 30, 1 << 30)
    assert (full.replicas, full.protocol, full.device, full.prefix, full.timeout_s) == (2, "rdma", "mlx5_0", "kvc/prod/", 0.5)
    assert parse_mooncake_url("mooncake://127.0.0.1:1").local_host == "127.0.0.1"  # the route to the master


@pytest.mark.parametrize(
    "url, message",
    [
        ("mooncake://m?protocol=udp", "not one of tcp, rdma"),
        ("mooncake://m?colour=blue", "unknown option"),
        ("mooncake://m/some/path", "no path"),
        ("mooncake://?metadata=x", "must name the master"),
        ("mooncake://m?segment=lots", "not a size"),
        ("mooncake://m?replicas=0", "must be >= 1"),
        ("mooncake://m?timeout_s=0", "must be a finite number"),
        ("mooncake://m?protocl=tcp", "did you mean protocol"),
    ],
)
def test_bad_mooncake_urls_are_rejected_clearly(url: str, message: str) -> None:
    with pytest.raises(StoreURLError, match=message):
        check_url(url)  # what the connector's config runs: the same refusal, no host resolved or reached
    with pytest.raises(StoreURLError, match=message):
        open_store(url)


def test_a_password_in_the_metadata_url_stays_out_of_errors_and_reprs() -> None:
    from storage.testing.ports import reserved_port as _free_port

    url = f"mooncake://127.0.0.1:{_free_port()}?metadata=redis://:s3cret@127.0.0.1:6379&local_host=127.0.0.1"
    with pytest.raises(StoreUnavailableError) as info:
        open_store(url)
    assert "s3cret" not in str(info.value) and ":***@" in str(info.value)


def test_a_missing_client_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # what Python does when the import fails
    monkeypatch.delitem(sys.modules, "storage.mooncake_store", raising=False)
    with pytest.raises(StoreURLError, match=r"pip install 'vllm-kvcodec\[mooncake\]'.*libibverbs1"):
        open_store("mooncake://127.0.0.1:1")
