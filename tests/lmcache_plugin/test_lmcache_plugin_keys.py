"""A value is served through LMCache only under the key it was written for.

LMCache's own ``LMCacheEngine`` (its token database, storage manager and
``RemoteBackend``, built from a config file) stores two prompts through the
plug-in; then the store swaps values between their keys. LMCache hands a remote
connector keys and KV, never token ids, so the key binding is what must refuse
the swap. LMCache's GPU connectors need a GPU: the engine here is given
:class:`HostKV`, which copies token ranges of a host tensor, the one piece of
LMCache's store and retrieve path a test supplies.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache")

from lmcache.v1.cache_engine import LMCacheEngine  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402

from storage import open_store  # noqa: E402
from tests.lmcache_plugin.test_lmcache_plugin import (  # noqa: E402,F401
    BACKEND,
    CHUNK,
    KV_SHAPE,
    MODEL,
    Engine,
    bits,
    chunks,
    connector_warnings,
    lmcache_engine,
    release,
    store_url,
    warnings_of_connector,
    write_config,
)
from vllm_kvcodec.format import encode_chunk  # noqa: E402
from vllm_kvcodec.lmcache_plugin import envelope  # noqa: E402

# Where the plug-in stored CacheEngineKey(MODEL, 1, 0, 0x5EED, bfloat16) before it bound values to keys.
UNBOUND_ERA_KEY = "lmc/v1/6bdae8ec255b049cb8f50ba26b6719d9/5eed"


class HostKV(GPUConnectorInterface):
    """KV in host memory, LMCache's KV_2LTD ``[2, layers, tokens, hidden]``: each call names its tensor (``kv=``)."""

    def from_gpu(self, memory_obj, start: int, end: int, *, kv: torch.Tensor, **_) -> None:
        memory_obj.tensor.copy_(kv[:, :, start:end])

    def to_gpu(self, memory_obj, start: int, end: int, *, kv: torch.Tensor, **_) -> None:
        kv[:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, KV_SHAPE[0], num_tokens, KV_SHAPE[3] * KV_SHAPE[4]])


@contextlib.contextmanager
def cache_engine(config_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LMCacheEngine, Engine]]:
    """LMCache's engine with the plug-in as its remote backend, and the test's handles on its storage."""
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "false")  # no usage report from a test
    config = LMCacheEngineConfig.from_file(str(config_path))
    metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, role="worker", chunk_size=CHUNK)
    start_method = multiprocessing.get_start_method(allow_none=True)
    engine = LMCacheEngine(config, metadata, ChunkedTokenDatabase(config, metadata), HostKV(), None, None)
    multiprocessing.set_start_method(start_method, force=True)  # LMCacheEngine forces "spawn" on the whole process
    try:
        engine.post_init()
        yield engine, Engine(engine.storage_manager, metadata)
    finally:
        engine.close()


def wait_for_puts(eng: Engine, n: int) -> None:
    deadline = time.monotonic() + 30
    while eng.connector.stats.puts < n:  # LMCache's store returns before its puts land
        assert time.monotonic() < deadline and eng.connector.stats.put_failures == 0
        time.sleep(0.005)


@pytest.mark.parametrize("store_url", ["file", "redis"], indirect=True)
def test_lmcache_engine_refuses_values_swapped_between_keys(store_url: str, real_kv_1k: torch.Tensor, tmp_path: Path,
                                                            monkeypatch, warnings_of_connector) -> None:
    kv = real_kv_1k.permute(1, 0, 2, 3, 4).reshape(2, 30, 1024, 192)
    source = {"a": kv[:, :, :512].contiguous(), "b": kv[:, :, 512:].contiguous()}  # two chunks of KV each
    prompts = {"a": torch.arange(100, 612), "b": torch.arange(5000, 5512)}
    with cache_engine(write_config(tmp_path, store_url), monkeypatch) as (engine, eng):
        for name in "ab":
            engine.store(prompts[name], kv=source[name])
        wait_for_puts(eng, 4)
        keys = {n: [key for _, _, key in engine.token_database.process_tokens(prompts[n])] for n in "ab"}
        second = {n: eng.connector.keys.store_key(keys[n][1]) for n in "ab"}
        with open_store(store_url) as store:  # the store answers each prompt's second chunk with the other's
            a, b = store.get(second["a"]), store.get(second["b"])
            store.put(second["a"], b)
            store.put(second["b"], a)
        warnings_of_connector.clear()

        for name, other in ("ab", "ba"):
            assert engine.lookup(prompts[name]) == 2 * CHUNK  # a value lies under every key ...
            out = torch.zeros_like(source[name])
            got = engine.retrieve(prompts[name], kv=out)
            assert got.tolist() == [True] * CHUNK + [False] * CHUNK  # ... but the swapped one is not retrieved
            assert torch.equal(bits(out[:, :, :CHUNK]), bits(source[name][:, :, :CHUNK]))
            assert not out[:, :, CHUNK:].any()  # nothing written where the swapped chunk would go
            assert not torch.equal(bits(source[name][:, :, CHUNK:]), bits(source[other][:, :, CHUNK:]))

            # LMCache's other load paths into the plug-in: a blocking get, a prefetch
            assert eng.backend.get_blocking(keys[name][1]) is None
            prefix = eng.run(eng.backend.batched_get_non_blocking("l", keys[name]))
            assert len(prefix) == 1 and torch.equal(bits(prefix[0].tensor), bits(source[name][:, :, :CHUNK]))
            release(*prefix)

        assert eng.connector.stats.unusable == 6
        texts = connector_warnings(warnings_of_connector)
        assert len(texts) == 6 and all("written for another key" in t for t in texts)
        eng.assert_all_freed()


def test_values_stored_before_key_binding_are_not_served(chunks, tmp_path: Path, warnings_of_connector) -> None:
    """The plug-in used to store unbound chunks under ``lmc/v1/``: it no longer looks there, nor takes them anywhere."""
    url = f"file://{tmp_path / 'store'}"
    unbound = envelope.pack("KV_2LTD", [encode_chunk(chunks[0], codec="rans")])  # what the plug-in wrote then
    with lmcache_engine(write_config(tmp_path, url)) as eng:
        key = eng.key(0x5EED)
        with open_store(url) as store:
            store.put(UNBOUND_ERA_KEY, unbound)
        assert not eng.backend.contains(key)  # where it lies is not looked up ...
        assert eng.backend.get_blocking(key) is None
        with open_store(url) as store:
            store.put(eng.connector.keys.store_key(key), unbound)
        warnings_of_connector.clear()
        assert eng.backend.contains(key)  # ... and where this plug-in looks, it is refused
        assert eng.backend.get_blocking(key) is None
        assert eng.sm.batched_get([key], location=BACKEND) == [None]
        assert eng.run(eng.backend.batched_get_non_blocking("l", [key])) == []
        texts = connector_warnings(warnings_of_connector)
        assert len(texts) == 3 and all("not bound to a key" in t for t in texts)
        eng.assert_all_freed()
