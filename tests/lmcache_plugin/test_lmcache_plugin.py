"""The LMCache storage plug-in, built the way LMCache builds it: config file -> StorageManager -> plug-in.

Everything here goes through LMCache 0.5.6's own objects: ``LMCacheEngineConfig.from_file``
on a YAML the test writes, ``StorageManager`` (which runs ``CreateStorageBackends`` ->
``RemoteBackend`` -> ``CreateConnector`` -> ``ConnectorManager``, which imports our adapter
from ``extra_config``), its real ``LocalCPUBackend`` allocator on the CPU, and its own
event-loop thread. Data is real SmolLM2 KV in LMCache's KV_2LTD layout
``[2, layers, tokens, kv_heads*head_dim]``. Only the vLLM side of LMCache needs a GPU
(tests/lmcache_plugin/test_lmcache_engine_gpu.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from storage import open_store, validate_key  # noqa: E402
from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header  # noqa: E402
from vllm_kvcodec.lmcache_plugin import KVCodecRemoteConnector, envelope  # noqa: E402
from vllm_kvcodec.lmcache_plugin.store_keys import ROOT, group_binding  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHUNK = 256
KV_SHAPE = (30, 2, CHUNK, 3, 64)  # LMCache's (layers, 2, chunk tokens, kv heads, head dim)
BACKEND = "RemoteBackend-kvcodec"
CONNECTOR_LOGGER = "vllm_kvcodec.lmcache_plugin.remote_connector"


# -- building LMCache the way it builds itself -----------------------------------


class Engine:
    """LMCache's StorageManager with our plug-in, plus handles on the pieces the tests poke at."""

    def __init__(self, sm: StorageManager, metadata: LMCacheMetadata) -> None:
        self.sm = sm
        self.metadata = metadata
        self.backend = sm.storage_backends[BACKEND]
        self.connection = self.backend.connection  # LMCache's InstrumentedRemoteConnector
        self.connector: KVCodecRemoteConnector = self.connection.getWrappedConnector()

    def key(self, chunk_hash: int | bytes, **kw) -> CacheEngineKey:
        return CacheEngineKey(self.metadata.model_name, self.metadata.world_size, self.metadata.worker_id,
                              chunk_hash, self.metadata.kv_dtype, **kw)

    def memory_obj(self, tensor: torch.Tensor):
        obj = self.sm.allocate([tensor.shape], [tensor.dtype])
        obj.tensor.copy_(tensor)
        return obj

    def put(self, keys, tensors) -> None:
        """LMCache's save path: StorageManager.batched_put -> RemoteBackend -> connector.batched_put."""
        s = self.connector.stats
        before = s.puts + s.put_failures
        objs = [self.memory_obj(t) for t in tensors]
        self.sm.batched_put(keys, objs)  # drops the caller's references itself
        deadline = time.monotonic() + 30
        while s.puts + s.put_failures < before + len(keys):  # the batched path returns no future
            assert time.monotonic() < deadline, "puts did not finish"
            time.sleep(0.005)

    def allocated(self) -> int:
        """Bytes LMCache's CPU allocator has handed out and not got back."""
        return self.sm.storage_backends["LocalCPUBackend"].memory_allocator.pin_allocator.total_allocated_size

    def assert_all_freed(self) -> None:
        deadline = time.monotonic() + 10
        while self.allocated():  # the last reference may drop in LMCache's loop thread a moment later
            assert time.monotonic() < deadline, f"{self.allocated()} bytes of LMCache memory never freed"
            time.sleep(0.01)

    def run(self, coro):
        """Run a coroutine on LMCache's own storage event loop, as RemoteBackend does."""
        return asyncio.run_coroutine_threadsafe(coro, self.sm.loop).result(30)


def write_config(tmp_path: Path, store: str, codec: str | None = None, extra: dict | None = None,
                 top: str = "") -> Path:
    lines = [
        f"chunk_size: {CHUNK}",
        "local_cpu: false",
        "max_local_cpu_size: 0.25",
        "save_unfull_chunk: true",
        top,
        'remote_storage_plugins: ["kvcodec"]',
        "extra_config:",
        "  remote_storage_plugin.kvcodec.module_path: vllm_kvcodec.lmcache_plugin",
        "  remote_storage_plugin.kvcodec.class_name: KVCodecConnectorAdapter",
        f'  remote_storage_plugin.kvcodec.store: "{store}"',
        "  remote_storage_plugin.kvcodec.threads: 2",
    ]
    if codec is not None:
        lines.append(f"  remote_storage_plugin.kvcodec.codec: {codec}")
    for k, v in (extra or {}).items():
        lines.append(f"  {k}: {v}")
    path = tmp_path / f"lmcache-{uuid.uuid4().hex[:8]}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def lmcache_engine(config_path: Path, model: str = MODEL, kv_shape=KV_SHAPE,
                   dtype: torch.dtype = torch.bfloat16, require_backend: bool = True) -> Iterator[Engine | StorageManager]:
    config = LMCacheEngineConfig.from_file(str(config_path))
    metadata = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=dtype, kv_shape=kv_shape, role="worker", chunk_size=CHUNK)
    sm = StorageManager(config, metadata, EventManager())
    try:
        yield Engine(sm, metadata) if require_backend else sm
    finally:
        sm.close()


@pytest.fixture(scope="module")
def chunks(real_kv_1k: torch.Tensor) -> list[torch.Tensor]:
    """Four real 256-token chunks in LMCache's KV_2LTD layout: [2, 30, 256, 192] bf16."""
    lmc = real_kv_1k.permute(1, 0, 2, 3, 4).reshape(2, 30, 1024, 3 * 64)
    return [c.contiguous() for c in lmc.split(CHUNK, dim=2)]


@pytest.fixture
def store_url(request, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    if request.param == "mooncake":
        return request.getfixturevalue("mooncake_url")
    return request.getfixturevalue("redis_url")


@pytest.fixture
def warnings_of_connector(caplog) -> Iterator[pytest.LogCaptureFixture]:
    """LMCache loggers do not propagate; hang pytest's handler on ours directly."""
    log = logging.getLogger(CONNECTOR_LOGGER)
    log.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)


def connector_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CONNECTOR_LOGGER and r.levelno == logging.WARNING]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bit_exact(obj, expected: torch.Tensor) -> None:
    assert obj is not None
    assert obj.get_shapes() == [expected.shape] and obj.get_dtypes() == [expected.dtype]
    assert obj.tensor.shape == expected.shape and obj.tensor.dtype == expected.dtype
    assert torch.equal(bits(obj.tensor), bits(expected))


def release(*objs) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def stored_value(url: str, key: str) -> bytes:
    with open_store(url) as store:
        value = store.get(key)
    assert value is not None
    return value


# -- round trips ---------------------------------------------------------------------

ROUND_TRIPS = [("file", c) for c in ("raw", "zstd", "splitzip", "rans", "video")] + [
    ("redis", c) for c in ("raw", "zstd", "splitzip", "rans")
] + [("mooncake", "rans")]


@pytest.mark.parametrize(("store_url", "codec"), ROUND_TRIPS, indirect=["store_url"],
                         ids=[f"{s}-{c}" for s, c in ROUND_TRIPS])
def test_round_trip_through_lmcache(store_url: str, codec: str, chunks, tmp_path: Path) -> None:
    data = chunks[:2] if codec == "video" else chunks
    with lmcache_engine(write_config(tmp_path, store_url, codec)) as eng:
        assert type(eng.connector) is KVCodecRemoteConnector
        keys = [eng.key(0x5EED00 + i) for i in range(len(data))]
        missing = eng.key(0xDEAD)
        eng.put(keys, data)
        assert eng.connector.stats.put_failures == 0

        # lookups, the ways LMCache does them
        assert eng.sm.batched_contains(keys)[0] == len(keys)
        assert eng.sm.batched_contains(keys + [missing])[0] == len(keys)
        assert eng.sm.batched_contains([missing] + keys)[0] == 0
        assert eng.backend.contains(keys[-1]) and not eng.backend.contains(missing)
        assert eng.run(eng.backend.batched_async_contains("l1", keys + [missing] + keys)) == len(keys)

        # blocking loads: StorageManager.batched_get -> RemoteBackend.batched_get_blocking -> batched_get
        got = eng.sm.batched_get(keys, location=BACKEND)
        for obj, want in zip(got, data):
            assert_bit_exact(obj, want)
        release(*got)
        one = eng.backend.get_blocking(keys[0])  # -> connector.get
        assert_bit_exact(one, data[0])
        release(one)
        assert eng.backend.get_blocking(missing) is None
        holes = eng.backend.batched_get_blocking([keys[0], missing, keys[1]])
        assert holes[1] is None
        assert_bit_exact(holes[0], data[0])
        assert_bit_exact(holes[2], data[1])
        release(*holes)

        # async loads (prefetch): only the stored prefix comes back
        prefix = eng.run(eng.backend.batched_get_non_blocking("l2", [keys[0], keys[1], missing, keys[0]]))
        assert len(prefix) == 2
        assert_bit_exact(prefix[0], data[0])
        assert_bit_exact(prefix[1], data[1])
        release(*prefix)

        # the stored objects really are our chunks, in the codec asked for
        store_key = eng.connector.keys.store_key(keys[0])
        validate_key(store_key)
        fmt, blobs = envelope.unpack(stored_value(store_url, store_key))
        assert fmt == "KV_2LTD" and len(blobs) == 1
        assert read_header(blobs[0], key=group_binding(store_key, 0)).codec_id == codec
        stats = eng.connector.stats
        assert stats.hits >= 2 * len(keys) and stats.unusable == 0
        if codec != "raw":
            assert stats.put_stored_bytes < 0.8 * stats.put_raw_bytes
        assert sorted(eng.run(eng.connection.list())) == sorted(k.to_string() for k in keys)

        # LMCache's remove, then the key is gone
        assert eng.backend.remove(keys[0])
        assert not eng.backend.contains(keys[0])
        assert eng.backend.get_blocking(keys[0]) is None
        assert eng.run(eng.connection.ping()) == 0
        eng.assert_all_freed()


def test_partial_chunk_and_single_puts(chunks, tmp_path: Path) -> None:
    """save_unfull_chunk: a 100-token last chunk comes back with its own shape; RemoteBackend.submit_put_task."""
    url = f"file://{tmp_path / 'store'}"
    part = chunks[1][:, :, :100].contiguous()
    with lmcache_engine(write_config(tmp_path, url)) as eng:
        assert eng.connector.settings.codec == "rans"
        key = eng.key(7)
        obj = eng.memory_obj(part)
        eng.backend.submit_put_task(key, obj).result(30)  # the single-put path -> connector.put
        release(obj)
        got = eng.backend.get_blocking(key)
        assert_bit_exact(got, part)
        assert got.get_num_tokens() == 100
        release(got)


class TwoGroupMetadata(LMCacheMetadata):
    """LMCache metadata of a model with two KV layer groups (as its KVLayerGroupsManager would report)."""

    def get_shapes(self, num_tokens=None):
        n = CHUNK if num_tokens is None else num_tokens
        return [torch.Size([2, 30, n, 192]), torch.Size([2, 4, n, 64])]

    def get_dtypes(self):
        return [torch.bfloat16, torch.bfloat16]

    def get_num_groups(self):
        return 2


def test_two_kv_groups_round_trip(chunks, tmp_path: Path) -> None:
    url = f"memory://lmc-{uuid.uuid4().hex}"
    config = LMCacheEngineConfig.from_file(str(write_config(tmp_path, url)))
    metadata = TwoGroupMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                                kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, role="worker", chunk_size=CHUNK)
    sm = StorageManager(config, metadata, EventManager())
    try:
        eng = Engine(sm, metadata)
        second = chunks[3][:, :4, :, :64].contiguous()
        obj = sm.allocate(metadata.get_shapes(), metadata.get_dtypes())
        obj.get_tensor(0).copy_(chunks[0])
        obj.get_tensor(1).copy_(second)
        key = eng.key(5)
        sm.batched_put([key], [obj])
        deadline = time.monotonic() + 30
        while eng.connector.stats.puts < 1:
            assert time.monotonic() < deadline and eng.connector.stats.put_failures == 0
            time.sleep(0.005)
        store_key = eng.connector.keys.store_key(key)
        _, blobs = envelope.unpack(stored_value(url, store_key))
        assert [read_header(b, key=group_binding(store_key, i)).shape for i, b in enumerate(blobs)] == [
            (2, 30, CHUNK, 192), (2, 4, CHUNK, 64)]
        got = eng.backend.get_blocking(key)
        assert got.get_shapes() == metadata.get_shapes()
        assert torch.equal(bits(got.get_tensor(0)), bits(chunks[0]))
        assert torch.equal(bits(got.get_tensor(1)), bits(second))
        release(got)
        eng.assert_all_freed()
    finally:
        sm.close()


# -- failures are misses, never data ------------------------------------------------


def test_timed_out_get_gives_its_memory_back(chunks, tmp_path: Path) -> None:
    """LMCache cancels a get that outlives blocking_timeout_secs; what the pool thread still allocates is freed."""
    path = tmp_path / "store"
    with lmcache_engine(write_config(tmp_path, f"file://{path}")) as fast:
        fast.put([fast.key(9)], [chunks[0]])
    slow = f"link+file://{path}?gbps=100&rtt_ms=2500"
    with lmcache_engine(write_config(tmp_path, slow, top="blocking_timeout_secs: 1")) as eng:
        start = time.monotonic()
        assert eng.backend.get_blocking(eng.key(9)) is None  # LMCache gave up ...
        assert time.monotonic() - start < 2.0
        deadline = time.monotonic() + 10
        while eng.connector.stats.hits < 1:  # ... our thread finished the get anyway ...
            assert time.monotonic() < deadline
            time.sleep(0.01)
        eng.assert_all_freed()  # ... and handed the MemoryObj back


def test_unreachable_store_gives_misses_not_errors(chunks, tmp_path: Path) -> None:
    from storage.testing.ports import reserved_port

    url = f"redis://127.0.0.1:{reserved_port()}/0?connect_timeout=0.5"  # nobody listens there
    with lmcache_engine(write_config(tmp_path, url)) as eng:  # Redis connects lazily: the backend exists
        key = eng.key(1)
        eng.put([key], [chunks[0]])
        assert eng.connector.stats.put_failures == 1
        assert not eng.backend.contains(key)
        assert eng.sm.batched_contains([key])[0] == 0
        assert eng.run(eng.backend.batched_async_contains("l", [key])) == 0
        assert eng.backend.get_blocking(key) is None
        assert eng.sm.batched_get([key], location=BACKEND) == [None]
        assert eng.run(eng.backend.batched_get_non_blocking("l", [key])) == []
        assert eng.run(eng.connection.ping()) != 0
        assert eng.connector.stats.store_errors >= 5
        eng.assert_all_freed()


@pytest.mark.parametrize("store_url", ["file", "redis", "mooncake"], indirect=True)
def test_corrupted_objects_are_logged_misses(store_url: str, chunks, tmp_path: Path, warnings_of_connector) -> None:
    with lmcache_engine(write_config(tmp_path, store_url, "rans")) as eng:
        keys = [eng.key(100 + i) for i in range(4)]
        eng.put(keys, chunks)
        sk = [eng.connector.keys.store_key(k) for k in keys]
        good = stored_value(store_url, sk[0])
        flipped = bytearray(good)
        flipped[len(flipped) // 2] ^= 0x10  # inside the codec payload: the chunk checksum catches it
        meta_flip = bytearray(good)
        meta_flip[12] ^= 0x01  # inside the envelope's JSON: its checksum catches it
        with open_store(store_url) as store:
            store.put(sk[1], bytes(flipped))
            store.put(sk[2], good[: len(good) // 3])  # truncated
            store.put(sk[3], bytes(meta_flip))
        warnings_of_connector.clear()

        for k in keys[1:]:
            assert eng.backend.contains(k)  # present in the store ...
            assert eng.backend.get_blocking(k) is None  # ... but never handed out
        got = eng.sm.batched_get(keys, location=BACKEND)
        assert_bit_exact(got[0], chunks[0])
        assert got[1:] == [None, None, None]
        release(got[0])
        # prefetch: a good object after the bad one is decoded too, then given back, not returned
        prefix = eng.run(eng.backend.batched_get_non_blocking("l", [keys[0], keys[1], keys[0]]))
        assert len(prefix) == 1
        assert_bit_exact(prefix[0], chunks[0])
        release(*prefix)

        assert eng.connector.stats.unusable == 7
        texts = connector_warnings(warnings_of_connector)
        assert len(texts) == 7 and all("unusable" in t and "miss" in t for t in texts)
        assert any("checksum" in t for t in texts)
        eng.assert_all_freed()


def test_shape_and_dtype_mismatches_are_misses(chunks, tmp_path: Path, warnings_of_connector) -> None:
    """Same model name and key, different geometry (or a wrong dtype planted under the key): a logged miss."""
    url = f"file://{tmp_path / 'store'}"
    with lmcache_engine(write_config(tmp_path, url)) as eng:
        key = eng.key(42)
        eng.put([key], [chunks[0]])
        store_key = eng.connector.keys.store_key(key)
        planted = eng.connector.keys.store_key(eng.key(43))
        with open_store(url) as store:  # a float32 chunk planted under the bf16 key of another chunk, bound to it
            store.put(planted, envelope.pack("KV_2LTD", [encode_chunk(chunks[1].float(), codec="zstd",
                                                                      key=group_binding(planted, 0))]))
        warnings_of_connector.clear()
        assert eng.backend.get_blocking(eng.key(43)) is None
    with lmcache_engine(write_config(tmp_path, url), kv_shape=(28, 2, CHUNK, 3, 64)) as other:
        assert other.connector.keys.store_key(key) == store_key  # LMCache's key does not name the geometry
        assert other.backend.contains(key)
        assert other.backend.get_blocking(key) is None
        assert other.connector.stats.unusable == 1
    texts = connector_warnings(warnings_of_connector)
    assert len(texts) == 2
    assert "float32" in texts[0] and "(2, 30, 256, 192)" in texts[1] and "(2, 28, 256, 192)" in texts[1]


def test_float16_falls_back_to_zstd(chunks, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    half = [c.to(torch.float16) for c in chunks[:2]]
    with lmcache_engine(write_config(tmp_path, url), dtype=torch.float16) as eng:
        assert eng.connector._codecs[torch.float16].codec_id == "zstd"
        keys = [eng.key(1), eng.key(2)]
        eng.put(keys, half)
        _, blobs = envelope.unpack(stored_value(url, eng.connector.keys.store_key(keys[0])))
        assert read_header(blobs[0]).codec_id == "zstd"
        got = eng.sm.batched_get(keys, location=BACKEND)
        for obj, want in zip(got, half):
            assert_bit_exact(obj, want)
        release(*got)


def test_keys_for_long_names_tags_and_odd_hashes(chunks, tmp_path: Path) -> None:
    """Store keys stay short printable ASCII; tags separate chunks; list() gives LMCache's own key strings."""
    url = f"memory://lmc-{uuid.uuid4().hex}"
    model = "org/" + "very-long-model-name-ü-" * 30
    with lmcache_engine(write_config(tmp_path, url), model=model) as eng:
        keys = [
            eng.key(-12345),
            eng.key(b"\x01" * 32),
            eng.key(-12345, request_configs={"lmcache.tag.user": "alice"}),
        ]
        store_keys = [eng.connector.keys.store_key(k) for k in keys]
        for sk in store_keys:
            assert validate_key(sk) == sk and len(sk) <= 7 + 32 + 1 + 128 and sk.startswith(ROOT)
        assert len(set(store_keys)) == 3
        eng.put(keys, chunks[:3])
        assert eng.sm.batched_contains(keys)[0] == 3
        got = eng.sm.batched_get(keys, location=BACKEND)
        for obj, want in zip(got, chunks[:3]):
            assert_bit_exact(obj, want)
        release(*got)
        listed = eng.run(eng.connection.list())
        assert sorted(listed) == sorted(k.to_string() for k in keys)
        # LMCache can parse them back (its from_string turns a bytes hash into an int, dropping leading zeros)
        assert CacheEngineKey.from_string(keys[2].to_string()) == keys[2]


def test_namespace_separates_deployments(chunks, tmp_path: Path) -> None:
    url = f"memory://lmc-{uuid.uuid4().hex}"
    with lmcache_engine(write_config(tmp_path, url, extra={"remote_storage_plugin.kvcodec.namespace": "a"})) as a:
        a.put([a.key(1)], [chunks[0]])
        assert a.backend.contains(a.key(1))
    with lmcache_engine(write_config(tmp_path, url, extra={"remote_storage_plugin.kvcodec.namespace": "b"})) as b:
        assert not b.backend.contains(b.key(1))


def test_shipped_example_config(chunks, redis_url: str, tmp_path: Path) -> None:
    """examples/lmcache_kvcodec.yaml as shipped, pointed at the test Redis (and a smaller CPU pool)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "lmcache_kvcodec.yaml"
    text = example.read_text()
    assert '"redis://localhost:6379/0"' in text and "max_local_cpu_size: 5 " in text
    path = tmp_path / "example.yaml"
    path.write_text(text.replace("redis://localhost:6379/0", redis_url).replace("max_local_cpu_size: 5 ", "max_local_cpu_size: 0.25 "))
    with lmcache_engine(path) as eng:
        key = eng.key(77)
        eng.put([key], [chunks[2]])
        got = eng.sm.batched_get([key], location=BACKEND)
        assert_bit_exact(got[0], chunks[2])
        release(*got)  # local_cpu: true keeps its own reference in LMCache's hot cache
        assert eng.sm.storage_backends["LocalCPUBackend"].contains(key)


def test_two_named_instances(chunks, tmp_path: Path) -> None:
    """remote_storage_plugins: [kvcodec.a, kvcodec.b]: two backends, each with its own settings."""
    urls = {n: f"memory://lmc-{n}-{uuid.uuid4().hex}" for n in "ab"}
    lines = [f"chunk_size: {CHUNK}", "local_cpu: false", "max_local_cpu_size: 0.25",
             'remote_storage_plugins: ["kvcodec.a", "kvcodec.b"]', "extra_config:"]
    for n, url in urls.items():
        lines += [f"  remote_storage_plugin.kvcodec.{n}.module_path: vllm_kvcodec.lmcache_plugin",
                  f"  remote_storage_plugin.kvcodec.{n}.class_name: KVCodecConnectorAdapter",
                  f'  remote_storage_plugin.kvcodec.{n}.store: "{url}"']
    lines.append("  remote_storage_plugin.kvcodec.b.codec: zstd")
    path = tmp_path / "two.yaml"
    path.write_text("\n".join(lines) + "\n")
    with lmcache_engine(path, require_backend=False) as sm:
        conns = {n: sm.storage_backends[f"RemoteBackend-kvcodec.{n}"].connection.getWrappedConnector() for n in "ab"}
        assert {n: c.store.url for n, c in conns.items()} == urls
        assert conns["a"]._codecs[torch.bfloat16].codec_id == "rans"
        assert conns["b"]._codecs[torch.bfloat16].codec_id == "zstd"


@pytest.mark.parametrize(
    ("extra", "top"),
    [
        ({"remote_storage_plugin.kvcodec.store": '""'}, ""),
        ({"remote_storage_plugin.kvcodec.codec": "nosuchcodec"}, ""),
        ({"remote_storage_plugin.kvcodec.typo": "1"}, ""),
        ({}, "remote_serde: cachegen"),
    ],
    ids=["no-store", "unknown-codec", "unknown-setting", "cachegen-serde"],
)
def test_configuration_errors_build_no_backend(extra, top, tmp_path: Path) -> None:
    url = f"memory://lmc-{uuid.uuid4().hex}"
    path = write_config(tmp_path, url, top=top)
    text = path.read_text()
    for k, v in extra.items():  # later YAML keys win
        text += f"  {k}: {v}\n"
    path.write_text(text)
    with lmcache_engine(path, require_backend=False) as sm:
        assert BACKEND not in sm.storage_backends
        assert "LocalCPUBackend" in sm.storage_backends


def test_importing_vllm_kvcodec_does_not_import_lmcache() -> None:
    code = (
        "import sys, vllm_kvcodec, vllm_kvcodec.format, vllm_kvcodec.codecs, storage\n"
        "assert 'lmcache' not in sys.modules and 'vllm_kvcodec.lmcache_plugin' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_envelope_rejects_garbage() -> None:
    from vllm_kvcodec.errors import ChunkFormatError

    blob = encode_chunk(torch.arange(64, dtype=torch.bfloat16).reshape(2, 32), codec="raw")
    packed = envelope.pack("KV_2LTD", [blob, blob])
    fmt, blobs = envelope.unpack(packed)
    assert fmt == "KV_2LTD" and [bytes(b) for b in blobs] == [blob, blob]
    assert torch.equal(decode_chunk(blobs[1]), decode_chunk(blob))
    for bad in (b"", b"LMKC", packed[:-1], packed + b"x", b"XXXX" + packed[4:], bytes(32)):
        with pytest.raises(ChunkFormatError):
            envelope.unpack(bad)
