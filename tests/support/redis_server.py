"""pytest fixtures for a real local redis-server (the start/stop code lives in storage.testing.redis_server).

The session server is shared by every Redis test; ``redis_url`` hands each test
an empty database (``redis_cluster_url`` the same for a one-node cluster). Each
pytest-xdist worker is a session of its own (``make test`` runs one per core), so
each has its own server on its own free port, and flushing it touches no other
worker's data. Tests that kill or freeze a server start their own with
:func:`short_lived_redis_server`, so the shared one stays healthy. A missing
redis-server fails the tests instead of skipping them: CI installs it
(``make test`` runs ``apt-get install redis-server`` when it is missing), and a
silent skip would hide the only real-network tests we have.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from storage.testing.redis_server import RedisServer, find_redis_server, start_redis_server


def _require_redis_server() -> None:
    if find_redis_server() is None:
        pytest.fail(
            "redis-server is not on PATH: install it (apt-get install redis-server, or `make redis-server`)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the whole session, on a free loopback port, nothing persisted."""
    _require_redis_server()
    server = start_redis_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, with its database flushed for this test."""
    _flush(redis_server.url)
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster_server() -> Iterator[RedisServer]:
    """A one-node Redis Cluster (every slot on one process): the cluster client path, for real."""
    _require_redis_server()
    server = start_redis_server(cluster=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster_server: RedisServer) -> str:
    """The one-node cluster's ``redis+cluster://`` URL, flushed for this test."""
    _flush(f"redis://127.0.0.1:{redis_cluster_server.port}/0")
    return redis_cluster_server.url


def _flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushall()
    finally:
        client.close()


@contextmanager
def short_lived_redis_server(
    extra_args: Sequence[str] = (), *, tls_files: dict[str, str] | None = None
) -> Iterator[RedisServer]:
    """A separate server a test may kill, freeze or misconfigure; always stopped afterwards."""
    _require_redis_server()
    server = start_redis_server(extra_args, tls_files=tls_files)
    try:
        yield server
    finally:
        server.stop()
