"""The store contract, checked the same way on every backend, plus each backend's own promises.

Concurrency tests write self-verifying values (length + xxhash64 header before a
random body), so a torn or mixed value is caught by whoever reads it.
"""

from __future__ import annotations

import array
import multiprocessing
import os
import random
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest
import xxhash

from storage import (
    InvalidKeyError,
    Store,
    StoreError,
    StoreUnavailableError,
    StoreURLError,
    check_url,
    open_store,
)
from storage.file_store import FileStore
from storage.testing.link import LinkEmulator
from storage.memory_store import MemoryStore
from tests.support.redis_server import (  # noqa: F401 (fixtures used by name)
    redis_cluster_server,
    redis_cluster_url,
    short_lived_redis_server,
)

MiB = 1 << 20

# --------------------------------------------------------------------------- helpers

_CHECK = struct.Struct("<QQ")


def checked_value(seed: int, size: int) -> bytes:
    """A value whose header (body length, xxhash64) lets any reader prove it is whole."""
    body = random.Random(seed).randbytes(size)
    return _CHECK.pack(size, xxhash.xxh64_intdigest(body)) + body


def assert_whole(blob: bytes) -> None:
    length, digest = _CHECK.unpack_from(blob)
    body = memoryview(blob)[_CHECK.size :]
    assert len(body) == length, f"torn value: header says {length} bytes, got {len(body)}"
    assert xxhash.xxh64_intdigest(body) == digest, "mixed value: checksum mismatch"


def disk_usage(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def url_for(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "memory":
        return f"memory://test-{uuid.uuid4().hex}"
    if kind == "file":
        return f"file://{tmp_path}/store"
    if kind == "file_capped":
        return f"file://{tmp_path}/store?max_bytes=64MiB"
    if kind == "file_small_cap":
        return f"file://{tmp_path}/store?max_bytes=1MiB"
    if kind == "redis":
        return request.getfixturevalue("redis_url") + "?prefix=test/"
    if kind == "redis_cluster":
        return request.getfixturevalue("redis_cluster_url") + "?prefix=test/"
    if kind == "mooncake":
        return request.getfixturevalue("mooncake_url")
    if kind == "link_memory":
        return f"link+memory://test-{uuid.uuid4().hex}?gbps=20&rtt_ms=0.05"
    raise AssertionError(kind)


REDIS_KINDS = [pytest.param(kind, marks=pytest.mark.redis) for kind in ("redis", "redis_cluster")]
MOONCAKE_KINDS = [pytest.param("mooncake", marks=pytest.mark.mooncake)]
ALL_KINDS = ["memory", "file", "file_capped", *REDIS_KINDS, *MOONCAKE_KINDS, "link_memory"]
SHARED_KINDS = ["file", "file_small_cap", *REDIS_KINDS, *MOONCAKE_KINDS]


@pytest.fixture(params=ALL_KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return url_for(request.param, tmp_path, request)


@pytest.fixture
def store(store_url: str):
    with open_store(store_url) as s:
        yield s


# --------------------------------------------------------------------------- the contract, on every store


def test_round_trip_from_one_byte_to_8_mib(store: Store) -> None:
    sizes = [0, 1, 255, 64 * 1024 + 3, MiB, 8 * MiB]
    values = {f"rt/{n}": os.urandom(n) for n in sizes}
    for key, value in values.items():
        store.put(key, value)
    for key, value in values.items():
        got = store.get(key)
        assert isinstance(got, bytes) and got == value


def test_put_accepts_any_contiguous_buffer(store: Store) -> None:
    floats = array.array("d", [1.5, -2.0, 3.25])
    store.put("buf/bytearray", bytearray(b"abc"))
    store.put("buf/memoryview", memoryview(b"xxdefxx")[2:5])
    store.put("buf/typed", memoryview(floats))
    assert store.get("buf/bytearray") == b"abc"
    assert store.get("buf/memoryview") == b"def"
    assert store.get("buf/typed") == floats.tobytes()
    with pytest.raises(TypeError):
        store.put("buf/str", "not bytes")  # type: ignore[arg-type]


def test_missing_key_is_none_not_an_error(store: Store) -> None:
    assert store.get("nope/0") is None
    assert store.exists("nope/0") is False
    assert store.get_many(["nope/1", "nope/2"]) == [None, None]
    assert store.exists_many(["nope/1"]) == [False]
    store.delete("nope/0")  # deleting what is not there is fine


def test_batched_operations_keep_order_and_report_gaps(store: Store) -> None:
    items = [(f"batch/{i:03d}", os.urandom(1000 + i)) for i in range(20)]
    store.put_many(items)
    store.put_many([])
    wanted = ["batch/005", "missing/a", "batch/000", "batch/019", "batch/005"]
    expected = {k: v for k, v in items}
    assert store.get_many(wanted) == [expected.get(k) for k in wanted]
    assert store.exists_many(wanted) == [k in expected for k in wanted]
    assert store.get_many([]) == [] and store.exists_many([]) == []


def test_overwrite_replaces_the_whole_value(store: Store) -> None:
    store.put("ow", b"a" * 100_000)
    store.put("ow", b"b" * 10)
    assert store.get("ow") == b"b" * 10
    store.put_many([("ow", b"c" * 5000)])
    assert store.get("ow") == b"c" * 5000


def test_replace_writes_only_over_the_value_it_was_given(store: Store) -> None:
    """A conditional write: over exactly ``expected``, never over another value, never where the key is gone."""
    store.put("cas/k", b"old" * 1000)
    assert not store.replace("cas/k", b"other", b"new")
    assert store.get("cas/k") == b"old" * 1000
    assert store.replace("cas/k", bytearray(b"old" * 1000), memoryview(b"new"))
    assert store.get("cas/k") == b"new"
    assert not store.replace("cas/k", b"old" * 1000, b"newer")  # what was read is no longer there
    assert store.get("cas/k") == b"new"
    assert not store.replace("cas/gone", b"old", b"new")  # deleted or evicted: not brought back
    assert store.get("cas/gone") is None and not store.exists("cas/gone")


def test_delete(store: Store) -> None:
    store.put("del/a", b"1")
    store.put("del/b", b"2")
    store.delete("del/a")
    assert store.get("del/a") is None and not store.exists("del/a")
    assert store.get("del/b") == b"2"


def test_keys_lists_original_keys_by_prefix(store: Store) -> None:
    long_key = "long/" + "k" * 507
    odd_key = "odd/[glob]*?\\ key"
    keys = {"ns1/a", "ns1/b/c", "ns2/a", long_key, odd_key}
    for key in keys:
        store.put(key, key.encode())
    assert set(store.keys()) == keys
    assert set(store.keys("ns1/")) == {"ns1/a", "ns1/b/c"}
    assert set(store.keys("odd/[glob]*")) == {odd_key}
    assert list(store.keys("zzz")) == []
    store.delete("ns1/a")
    assert set(store.keys("ns1")) == {"ns1/b/c"}


BAD_KEYS = ["", "/abs", "a/../b", "..", "a//b", "trailing/", "./a", "caf\u00e9", "tab\tkey", "x" * 513, 42, b"bytes"]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda k: repr(k)[:20])
def test_bad_keys_are_rejected_clearly(store: Store, bad: object) -> None:
    for call in (
        lambda: store.get(bad),  # type: ignore[arg-type]
        lambda: store.put(bad, b"v"),  # type: ignore[arg-type]
        lambda: store.exists(bad),  # type: ignore[arg-type]
        lambda: store.delete(bad),  # type: ignore[arg-type]
        lambda: store.get_many(["ok", bad]),  # type: ignore[list-item]
        lambda: store.put_many([("ok", b"v"), (bad, b"v")]),  # type: ignore[list-item]
    ):
        with pytest.raises(InvalidKeyError, match="key"):
            call()
    assert store.get("ok") is None  # a rejected batch wrote nothing


def test_closed_store_refuses_calls(store_url: str) -> None:
    store = open_store(store_url)
    with store:
        store.put("c", b"1")
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.get("c")
    store.close()  # idempotent


def test_many_threads_never_see_a_torn_value(store: Store) -> None:
    keys = [f"hot/{i}" for i in range(4)]
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(25):
                store.put(rng.choice(keys), checked_value(seed * 1000 + i, rng.randrange(1, 256 * 1024)))
                blobs = [store.get(rng.choice(keys)), *store.get_many(keys)]
                for blob in blobs:
                    if blob is not None:
                        assert_whole(blob)
        except BaseException as exc:  # surfaced by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures, failures[0]
    assert all(store.get(k) is not None for k in keys)


# --------------------------------------------------------------------------- several processes, one store


def _process_worker(args: tuple[str, int]) -> int:
    """Runs in a spawned process: hammer a few shared keys, verify every read."""
    url, seed = args
    rng = random.Random(seed)
    keys = [f"shared/{i}" for i in range(8)]
    verified = 0
    with open_store(url) as store:
        for i in range(40):
            store.put(rng.choice(keys), checked_value(seed * 1000 + i, rng.randrange(1, 400 * 1024)))
            for blob in (store.get(rng.choice(keys)), *store.get_many(keys[:3])):
                if blob is not None:
                    assert_whole(blob)
                    verified += 1
    return verified


@pytest.mark.parametrize("kind", SHARED_KINDS)
def test_several_processes_share_one_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = url_for(kind, tmp_path, request)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        verified = pool.map(_process_worker, [(url, seed) for seed in range(4)], chunksize=1)
    assert sum(verified) > 0
    with open_store(url) as store:
        for blob in store.get_many(f"shared/{i}" for i in range(8)):
            if blob is not None:
                assert_whole(blob)
    if kind == "file_small_cap":
        assert disk_usage(tmp_path / "store") <= MiB


# --------------------------------------------------------------------------- file store


def test_file_writes_leave_no_temp_files_and_keys_skip_them(tmp_path: Path) -> None:
    with FileStore(tmp_path) as store:
        store.put("a", b"1" * 1000)
        store.put("a", b"2" * 10)
        leftovers = [p for p in tmp_path.rglob(".*.tmp")]
        assert leftovers == []
        (Path(store._path("a")).parent / ".stray.tmp").write_bytes(b"partial")
        assert list(store.keys()) == ["a"]


def test_file_replace_leaves_a_put_that_lands_after_its_comparison(tmp_path: Path) -> None:
    """Another writer's put renamed into place after the comparison (here: while the new value's temp file is being
    written), even of the very bytes compared, is not overwritten: the path no longer names the file compared."""
    other = FileStore(tmp_path)

    class PutMeanwhile(FileStore):
        def _write_temp(self, tmp: str, header: bytes, value: memoryview) -> None:
            super()._write_temp(tmp, header, value)
            other.put("k", b"old")  # a newer save of the same bytes

    with PutMeanwhile(tmp_path) as store:
        store.put("k", b"old")
        before = os.stat(store._path("k")).st_ino
        assert not store.replace("k", b"old", b"upgraded")
        assert store.get("k") == b"old" and os.stat(store._path("k")).st_ino != before
        assert [p for p in tmp_path.rglob(".*.tmp")] == []
    other.close()


def test_file_corrupt_object_is_a_store_error(tmp_path: Path) -> None:
    with FileStore(tmp_path) as store:
        store.put("k", b"value")
        Path(store._path("k")).write_bytes(b"garbage")
        with pytest.raises(StoreError, match="header"):
            store.get("k")
        assert list(store.keys()) == []


def test_file_lru_evicts_least_recently_used(tmp_path: Path) -> None:
    cap = 1_000_000
    with FileStore(tmp_path, max_bytes=cap) as store:
        for i in range(9):
            store.put(f"k{i}", bytes(100_000))
        assert store.get("k0") is not None  # k0 becomes the most recently used
        store.put("k9", bytes(100_000))  # crosses the cap
        assert store.exists("k0") and store.exists("k9")
        assert not store.exists("k1"), "the least recently used object should go first"
        assert disk_usage(tmp_path) <= cap
        assert len(list(store.keys())) < 10


def test_file_cap_charges_overwrites_once(tmp_path: Path) -> None:
    with FileStore(tmp_path, max_bytes=1_000_000) as store:
        for i in range(5):
            store.put(f"cold/{i}", bytes(100_000))
        for _ in range(50):
            store.put("hot", bytes(100_000))
        assert all(store.exists(f"cold/{i}") for i in range(5))
        store.delete("hot")
        for i in range(4):
            store.put(f"more/{i}", bytes(100_000))
        assert all(store.exists(f"cold/{i}") for i in range(5)), "a delete must give its bytes back"


def test_file_cap_is_enforced_across_handles_and_reopen(tmp_path: Path) -> None:
    with FileStore(tmp_path) as uncapped:  # fill past the cap with no accounting at all
        for i in range(30):
            uncapped.put(f"old/{i}", bytes(100_000))
    with FileStore(tmp_path, max_bytes=1_000_000) as a, FileStore(tmp_path, max_bytes=1_000_000) as b:
        assert disk_usage(tmp_path) <= 1_000_000, "opening a capped store measures and evicts"
        for i in range(20):
            (a if i % 2 else b).put(f"new/{i}", bytes(100_000))
        assert disk_usage(tmp_path) <= 1_000_000
        assert a.exists("new/19") and b.exists("new/18")


def test_file_object_larger_than_cap_is_refused(tmp_path: Path) -> None:
    with FileStore(tmp_path, max_bytes=1000) as store:
        with pytest.raises(StoreError, match="cannot fit"):
            store.put("big", bytes(2000))
        assert store.get("big") is None  # and nothing half-written is left


def test_file_fan_out_uses_two_hex_levels(tmp_path: Path) -> None:
    with FileStore(tmp_path) as store:
        store.put("some/key", b"x")
        (obj,) = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
        rel = obj.relative_to(tmp_path).parts
        assert len(rel) == 3 and rel[2].startswith(rel[0] + rel[1]) and len(rel[2]) == 32


# --------------------------------------------------------------------------- memory store


def test_named_memory_stores_share_data_private_ones_do_not() -> None:
    name = f"shared-{uuid.uuid4().hex}"
    with open_store(f"memory://{name}") as a, open_store(f"memory://{name}") as b:
        a.put("x", b"1")
        assert b.get("x") == b"1"
    with open_store("memory://") as c, open_store("memory://") as d:
        c.put("x", b"1")
        assert d.get("x") is None
    assert isinstance(open_store("memory://"), MemoryStore)


# --------------------------------------------------------------------------- link emulator


def test_link_throughput_matches_the_set_bandwidth() -> None:
    gbps, threads, per_thread, size = 0.4, 4, 10, MiB
    link = LinkEmulator(MemoryStore(), gbps=gbps, rtt_ms=0.5)
    payload = os.urandom(size)

    def move(fn) -> float:
        workers = [threading.Thread(target=fn, args=(t,)) for t in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return threads * per_thread * size * 8 / (time.perf_counter() - start) / 1e9

    def put(t: int) -> None:
        for i in range(per_thread):
            link.put(f"t{t}/{i}", payload)

    def get(t: int) -> None:
        for i in range(0, per_thread, 5):
            assert all(v is not None for v in link.get_many(f"t{t}/{j}" for j in range(i, i + 5)))

    put_gbps, get_gbps = move(put), move(get)
    assert put_gbps == pytest.approx(gbps, rel=0.10)
    assert get_gbps == pytest.approx(gbps, rel=0.10)


def test_link_charges_one_rtt_per_batch() -> None:
    link = LinkEmulator(MemoryStore(), gbps=100, rtt_ms=20)
    keys = [f"k{i}" for i in range(5)]
    start = time.perf_counter()
    for key in keys:
        link.exists(key)
    one_by_one = time.perf_counter() - start
    start = time.perf_counter()
    link.exists_many(keys)
    batched = time.perf_counter() - start
    assert one_by_one >= 5 * 0.020
    assert 0.020 <= batched < 0.060


def test_link_from_url_wraps_the_inner_store(tmp_path: Path) -> None:
    with open_store(f"link+file://{tmp_path}?gbps=2.5&rtt_ms=0.25&max_bytes=1MiB") as store:
        assert isinstance(store, LinkEmulator) and isinstance(store.inner, FileStore)
        assert store.inner._cap is not None and store.inner._cap.max_bytes == MiB
        store.put("a", b"1")
        assert store.get("a") == b"1"
        assert "gbps=2.5" in store.url and "rtt_ms=0.25" in store.url


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://host/x", "unknown store scheme"),
        ("/just/a/path", "not a store URL"),
        ("file:///tmp/x?max_bytes=lots", "not a size"),
        ("file:///tmp/x?fsync=maybe", "not a boolean"),
        ("file:///tmp/x?colour=blue", "unknown option"),
        ("file:///tmp/x?fsync=1&fsync=0", "twice"),
        ("file://otherhost/x", "local path"),
        ("memory://x?size=1", "unknown option"),
        ("link+memory://", "needs gbps"),
        ("link+memory://?gbps=fast", "not a number"),
        ("redis://localhost:6379/0?socket_timeout=-1", "must be a finite number"),
        ("redis://localhost:6379/0?bogus=1", "unknown option"),
        ("redis://localhost:6379/0?connect_timeout=1&socket_connect_timeout=2", "not both"),
        ("redis://localhost:6379/0?read_timout=1", "unknown option.*did you mean read_timeout"),
        ("redis://localhost:63x9/0", "Port could not be cast"),
        ("redis://localhost:6379/0?max_connections=many", "Invalid value for 'max_connections'"),
        ("faults+memory://?seed=one", "not an integer"),
        ("faults+memory://?drop=0.1&colour=blue", "unknown option"),
        ("link+file://tmp/x?gbps=1", "write file:///tmp/x"),
    ],
)
def test_bad_urls_are_rejected_clearly(url: str, message: str) -> None:
    """Opening refuses them, and so does check_url (what the connector's config runs) without opening anything."""
    with pytest.raises(StoreURLError, match=message):
        check_url(url)
    with pytest.raises(StoreURLError, match=message):
        open_store(url)


def test_redis_url_options_reach_redis_py_and_password_is_redacted() -> None:
    from storage.redis_store import RedisStore

    store = open_store("redis://alice:s3cret@127.0.0.1:1/2?prefix=kv/&connect_timeout=0.5")
    assert isinstance(store, RedisStore)
    kwargs = store._client.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] == 0.5 and kwargs["socket_timeout"] == 5.0
    assert kwargs["db"] == 2 and kwargs["password"] == "s3cret"
    assert kwargs["retry"].get_retries() == 1
    assert store.prefix == "kv/"
    assert "s3cret" not in repr(store) and "alice:***@" in repr(store)
    with pytest.raises(StoreUnavailableError) as info:
        store.get("k")  # nothing listens on port 1
    assert "s3cret" not in str(info.value) and "s3cret" not in str(info.value.__cause__)


# --------------------------------------------------------------------------- Redis specifics


@pytest.mark.redis
def test_redis_prefixes_isolate_deployments(redis_url: str) -> None:
    with open_store(redis_url + "?prefix=a/") as a, open_store(redis_url + "?prefix=b/") as b:
        a.put("k", b"from a")
        b.put("k", b"from b")
        assert a.get("k") == b"from a" and b.get("k") == b"from b"
        assert list(a.keys()) == ["k"]
        a.delete("k")
        assert b.get("k") == b"from b"


@pytest.mark.redis
def test_redis_unreachable_fails_fast() -> None:
    from storage.testing.ports import reserved_port as _free_port

    port = _free_port()
    store = open_store(f"redis://127.0.0.1:{port}/0")
    start = time.monotonic()
    for call in (lambda: store.get("k"), lambda: store.put_many([("k", b"v")]), lambda: store.get_many(["k"])):
        with pytest.raises(StoreUnavailableError):
            call()
    assert time.monotonic() - start < 2
    with pytest.raises(StoreUnavailableError):
        open_store(f"redis+cluster://127.0.0.1:{port}")  # a cluster client connects at open


@pytest.mark.redis
@pytest.mark.timeout(30)
def test_redis_killed_mid_stream_raises_unavailable_without_hanging() -> None:
    with short_lived_redis_server() as server:
        store = open_store(server.url + "?socket_timeout=1&connect_timeout=1")
        payload = os.urandom(MiB)
        outcome: list[tuple[BaseException, float]] = []

        def traffic() -> None:
            try:
                for i in range(10**6):
                    store.put_many([(f"k{i % 8}/{j}", payload) for j in range(4)])
                    store.get_many([f"k{i % 8}/{j}" for j in range(4)])
            except BaseException as exc:
                outcome.append((exc, time.monotonic()))

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        time.sleep(0.3)
        killed_at = time.monotonic()
        server.kill()
        thread.join(10)
        assert not thread.is_alive(), "a call hung after the server died"
        exc, failed_at = outcome[0]
        assert isinstance(exc, StoreUnavailableError), exc
        assert failed_at - killed_at < 3
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            store.get("k0/0")
        assert time.monotonic() - start < 2
        store.close()


@pytest.mark.redis
@pytest.mark.timeout(30)
def test_redis_frozen_server_times_out_within_the_read_timeout() -> None:
    with short_lived_redis_server() as server:
        with open_store(server.url + "?read_timeout=0.5&connect_timeout=0.5") as store:
            store.put("k", b"v")
            server.freeze()
            try:
                for call in (lambda: store.get("k"), lambda: store.exists_many(["k"])):
                    start = time.monotonic()
                    with pytest.raises(StoreUnavailableError, match="Timeout"):
                        call()
                    assert time.monotonic() - start < 2
            finally:
                server.thaw()
            assert store.get("k") == b"v", "the store recovers when the server does"


def _make_tls_files(directory: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1, so a real TLS handshake can be verified."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def cert(subject, public_key, extensions):
        builder = x509.CertificateBuilder().subject_name(subject).issuer_name(name("kvcodec test CA"))
        builder = builder.public_key(public_key).serial_number(x509.random_serial_number())
        builder = builder.not_valid_before(now - datetime.timedelta(minutes=5))
        builder = builder.not_valid_after(now + datetime.timedelta(days=1))
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    ca = cert(name("kvcodec test CA"), ca_key.public_key(), [(x509.BasicConstraints(ca=True, path_length=None), True)])
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    leaf = cert(name("127.0.0.1"), key.public_key(), [(san, False)])
    files = {"ca": directory / "ca.pem", "cert": directory / "server.pem", "key": directory / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {k: str(v) for k, v in files.items()}


@pytest.mark.redis
def test_rediss_passes_tls_options_to_redis_py(tmp_path: Path) -> None:
    tls = _make_tls_files(tmp_path)
    with short_lived_redis_server(tls_files=tls) as server:
        assert server.url.startswith("rediss://")
        with open_store(f"{server.url}?ssl_ca_certs={tls['ca']}") as store:
            store.put("tls", b"secret bytes")
            assert store.get("tls") == b"secret bytes"
        with open_store(f"{server.url}?ssl_cert_reqs=none") as unverified:
            assert unverified.get("tls") == b"secret bytes"
        untrusted = open_store(server.url)  # the system CAs do not know our test CA
        with untrusted, pytest.raises(StoreUnavailableError, match="certificate"):
            untrusted.get("tls")
