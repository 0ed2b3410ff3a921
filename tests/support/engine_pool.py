"""Engines shared by the tests that need the same configuration: the ``engines`` fixture (tests/conftest.py).

Starting a vLLM engine on 2 cores costs more than most engine tests' own work, and most engine tests need one of
a few configurations. A test states the configuration it needs and asks the session's pool for it::

    def test_x(engines):
        e = engines.get(connected(codec="rans", chunk_size=128, dtype="float32"))  # its own empty file store
        greedy(e.llm, ids)
        assert e.conn.flush(120) and e.counters()["saved_chunks"] == 7

``get`` hands out the live engine when it has that configuration, reset, or stops it and starts one that has
(vLLM's in-process engines share process-wide distributed groups: one is alive at a time, so tests of one
configuration should follow each other). Reset means: the step a finished request is owed is taken (see
vllm_kvcodec/tools/offline_engine.py), saves are flushed, vLLM's prefix cache is emptied together with the
connector's memory of its store (``reset_prefix_cache(reset_connector=True)``), the store is emptied, and
``counters()`` count from zero. ``e.reset(keep_store=True)`` within a test is "a fresh engine on the same store"
for what the connector and vLLM's cache know; a test that must observe a really fresh engine (its start-up, its
shutdown, the workers' handshake, a cache as allocated) uses :func:`tests.support.engine.engine`, which stops the
shared engine first, and says why.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tests.support.engine import connector_config, start_engine, stop_engine, worker_connector

logger = logging.getLogger(__name__)

#: Ratios of totals: not counters, so not in ``counters()``.
RATIOS = ("save_ratio", "load_ratio")
#: Steps taken at most to let finished requests go before a reset (one is owed per finished request batch).
FINISHING_STEPS = 8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a test needs of its engine; equal configurations share one.

    ``store``: None for no connector; ``"file"`` (an empty file store of the engine's own), ``"redis"`` (the
    pool's redis-server, flushed), or a URL template whose ``{root}`` is the engine's own store directory
    (``"faults+file://{root}?down=1"``). ``connector``: the connector's other settings, defaults left out.
    """

    dtype: str = "bfloat16"
    prefix_caching: bool = True
    store: str | None = None
    connector: tuple[tuple[str, Any], ...] = ()
    engine_args: tuple[tuple[str, Any], ...] = ()


def plain(dtype: str = "bfloat16", prefix_caching: bool = True, **engine_args: Any) -> EngineConfig:
    """An engine without the connector (the references: vLLM's own prefix cache, or a full recompute)."""
    return EngineConfig(dtype, prefix_caching, None, (), _items(engine_args))


def connected(store: str = "file", *, dtype: str = "bfloat16", prefix_caching: bool = True,
              engine_args: dict[str, Any] | None = None, **connector: Any) -> EngineConfig:
    """An engine with the connector on its own empty ``store`` (see :class:`EngineConfig`)."""
    from vllm_kvcodec.connector.config import ConnectorConfig

    defaults = {name: field.default for name, field in ConnectorConfig.model_fields.items()}
    settings = {k: v for k, v in connector.items() if k not in defaults or defaults[k] != v}
    return EngineConfig(dtype, prefix_caching, store, _items(settings), _items(engine_args or {}))


def _items(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    items = tuple(sorted(settings.items()))
    hash(items)  # a dict or list value cannot key a shared engine: say so here, not in a later lookup
    return items


class Totals:
    """A connector's totals since a mark, non-zero only (as ``stats()`` leaves zeros out): a shared engine's own
    totals span every test it served."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.mark()

    def mark(self) -> None:
        self._at = self.conn.stats()

    def __call__(self) -> dict[str, float]:
        out = {}
        for key, value in self.conn.stats().items():
            delta = value - self._at.get(key, 0)
            if key not in RATIOS and delta:
                out[key] = round(delta, 4) if isinstance(delta, float) else delta
        return out


def reset_engine(llm: Any, conn: Any = None, *, connector: bool | None = None) -> None:
    """Nothing owed, nothing cached: the steps owed to finished requests taken, ``conn``'s saves flushed, vLLM's
    prefix cache emptied, and the connector's memory of its store too (with ``conn``, or ``connector=True`` for an
    engine whose workers are processes of their own: flush them first)."""
    _finish_requests(llm)
    if conn is not None:
        assert conn.flush(120), "saves still queued after 120 s"
    connector = conn is not None if connector is None else connector
    assert llm.reset_prefix_cache(reset_connector=connector), "vLLM refused to reset its prefix cache: blocks still held"


class SharedEngine:
    """The pool's live engine: ``llm``, the store's ``url``, its worker-side connector ``conn`` (None without)."""

    def __init__(self, config: EngineConfig, root: Path, redis_url: str | None) -> None:
        self.config = config
        self.root = root
        self.url = _store_url(config.store, root, redis_url)
        settings = dict(config.connector)
        kv = connector_config(self.url, settings.pop("codec", None), **settings) if self.url is not None else None
        self.llm = start_engine(kv, config.dtype, config.prefix_caching, **dict(config.engine_args))
        self.conn = worker_connector() if kv is not None else None
        self.counters = Totals(self.conn) if self.conn is not None else None
        self.scheduler_counters = Totals(scheduler_connector()) if self.conn is not None else None

    def reset(self, keep_store: bool = False) -> None:
        """:func:`reset_engine`, counters from zero, and the store emptied unless ``keep_store``."""
        reset_engine(self.llm, self.conn)
        if self.url is not None and not keep_store:
            self._clear_store()
        for totals in (self.counters, self.scheduler_counters):
            if totals is not None:
                totals.mark()

    def stop(self) -> None:
        llm, self.llm, self.conn = self.llm, None, None
        self.counters = self.scheduler_counters = None  # they hold the connectors: let them go with the engine
        stop_engine(llm)

    def _clear_store(self) -> None:
        from storage import open_store

        if self.config.store == "redis":
            _flush_redis(self.url)
            return
        if self.root.exists():  # a file store under every wrapper: emptied through the plain one
            with open_store(f"file://{self.root}") as store:
                for key in list(store.keys()):
                    store.delete(key)


def scheduler_connector() -> Any:
    """The newest scheduler-side KVCodecConnector in this process (an in-process engine's)."""
    from vllm_kvcodec.connector.facade import live_connectors

    return next(c for c in reversed(live_connectors()) if c.scheduler is not None)


class EnginePool:
    """At most one live :class:`SharedEngine`; a redis-server of its own, started when a configuration needs it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.live: SharedEngine | None = None
        self.started = 0
        self._redis: Any = None

    def get(self, config: EngineConfig, fresh: bool = False) -> SharedEngine:
        """The live engine of ``config``, reset; ``fresh``: started anew even if live, for a test whose assertions
        count from the engine's start (a fault injector's seeded sequence of faults)."""
        if self.live is not None and self.live.config == config and not fresh:
            try:
                self.live.reset()
                return self.live
            except Exception:  # a test left it in a state no reset undoes: a new one, and the log says why
                logger.exception("shared engine: reset failed, starting a new one")
        self.stop()
        self.started += 1
        redis_url = self._redis_url() if config.store == "redis" else None
        self.live = SharedEngine(config, self.root / f"store{self.started}", redis_url)
        if config.store == "redis":
            _flush_redis(self.live.url)
        return self.live

    def stop(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            live.stop()

    def close(self) -> None:
        self.stop()
        if self._redis is not None:
            self._redis.stop()

    def _redis_url(self) -> str:
        if self._redis is None:
            from storage.testing.redis_server import start_redis_server

            self._redis = start_redis_server()
        return self._redis.url


#: The session's pool (set by the ``engines`` fixture), so that an engine of a test's own stops its engine first.
POOL: EnginePool | None = None


def stop_shared_engine() -> None:
    """Stop the shared engine, if one is alive: another engine is about to start in this process."""
    if POOL is not None:
        POOL.stop()


def _store_url(store: str | None, root: Path, redis_url: str | None) -> str | None:
    if store is None:
        return None
    if store == "redis":
        assert redis_url is not None
        return redis_url
    if store == "file":
        return f"file://{root}"
    assert "{root}" in store, f"store {store!r}: 'file', 'redis' or a URL template with {{root}}"
    return store.format(root=root)


def _finish_requests(llm: Any) -> None:
    """Take the steps owed to finished requests (and abort what a failed test left running)."""
    from vllm_kvcodec.tools.offline_engine import take_finishing_step

    engine = llm.llm_engine
    for _ in range(FINISHING_STEPS):
        take_finishing_step(llm)
        if not engine.has_unfinished_requests():
            break
    core = getattr(engine.engine_core, "engine_core", None)
    if core is not None and core.scheduler.has_requests():
        engine.abort_request(list(core.scheduler.requests), internal=True)
        take_finishing_step(llm)


def _flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushall()
    finally:
        client.close()
