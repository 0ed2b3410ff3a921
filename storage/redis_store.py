"""``redis://``, ``rediss://`` and ``redis+cluster://`` — a shared store several hosts can reach.

Works with Redis and Valkey (only plain GET/SET/MGET/EXISTS/DEL/SCAN are used, and
WATCH/MULTI/EXEC for a conditional write).

Why the defaults differ from redis-py's: a KV lookup sits on the prefill path,
where a hung store is worse than a miss. So connect and read timeouts are
bounded (2 s and 5 s), and retries are limited to one immediate reconnect on a
dropped connection (a pooled socket the server closed) and never retry a
timeout, so a dead server costs at most about one timeout before
:class:`~storage.errors.StoreUnavailableError`.

URL options (query parameters):

``prefix``
    prepended to every key, so several deployments can share one database
    (``?prefix=kvcodec/prod/``).
``connect_timeout`` / ``socket_connect_timeout``
    seconds to establish a connection (default 2).
``read_timeout`` / ``socket_timeout``
    seconds to wait for a reply (default 5).
``retries``
    reconnect attempts after a dropped connection (default 1, 0 disables).
anything redis-py's ``from_url`` understands
    ``max_connections``, ``health_check_interval``, ``client_name``,
    ``protocol``, and for ``rediss://`` the TLS options ``ssl_cert_reqs``
    (``none``/``optional``/``required``), ``ssl_ca_certs``, ``ssl_ca_path``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_password``, ``ssl_check_hostname``,
    ``ssl_min_version``, ``ssl_ciphers``.

``redis+cluster://host:port`` (or ``rediss+cluster://``) opens a
``RedisCluster`` seeded from that node; it connects at open time to learn the
slot map, and batched reads use ``mget_nonatomic`` since MGET cannot span slots.
Single-server URLs connect lazily: opening never fails because the server is
down, the first operation does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from storage.base import Store, validate_prefix
from storage.errors import StoreError, StoreUnavailableError, StoreURLError
from storage.options import parse_float, parse_int, redact_url, reject_unknown, split_query, with_query

DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_READ_TIMEOUT = 5.0
DEFAULT_RETRIES = 1
_SCAN_BATCH = 1000

_ALIASES = {"connect_timeout": "socket_connect_timeout", "read_timeout": "socket_timeout"}
_OWN = {"prefix", "retries", *_ALIASES}
_TIMEOUTS = {"socket_connect_timeout", "socket_timeout"}
# redis-py's own URL options, less those that fight the retry policy above or need
# a BlockingConnectionPool (``timeout``).
_PASSED_THROUGH = set(URL_QUERY_ARGUMENT_PARSERS) - {"timeout", "retry_on_timeout", "retry_on_error"} | {
    "client_name",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_ciphers",
}
_UNAVAILABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    RedisClusterException,
    redis.exceptions.ClusterError,
    OSError,
)


class RedisStore(Store):
    def __init__(self, url: str) -> None:
        super().__init__(redact_url(url))
        redis_url, self._cluster, self._prefix, retries, timeouts = _settings(url)
        with self._translate("connect"):
            try:
                self._client = _make_client(redis_url, self._cluster, retries, timeouts)
            except ValueError as exc:  # redis-py's complaint about an option value
                raise StoreURLError(f"{self.url}: {exc}") from None

    @property
    def prefix(self) -> str:
        return self._prefix

    def _get(self, key: str) -> bytes | None:
        with self._translate("GET"):
            return self._client.get(self._prefix + key)

    def _put(self, key: str, value: memoryview) -> None:
        with self._translate("SET"):
            self._client.set(self._prefix + key, value)

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        """WATCH, GET, compare, then SET in MULTI/EXEC: Redis refuses the SET if anyone wrote the key after the
        WATCH, so it is atomic (one more read of the value than a put, no server-side script)."""
        full = self._prefix + key
        with self._translate("WATCH/GET/SET"), self._client.pipeline(transaction=True) as pipe:
            pipe.watch(full)
            if pipe.get(full) != expected:
                return False
            pipe.multi()
            pipe.set(full, value)
            try:
                pipe.execute()
            except redis.WatchError:
                return False
        return True

    def _exists(self, key: str) -> bool:
        with self._translate("EXISTS"):
            return bool(self._client.exists(self._prefix + key))

    def _delete(self, key: str) -> None:
        with self._translate("DEL"):
            self._client.delete(self._prefix + key)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        full = [self._prefix + k for k in keys]
        with self._translate("MGET"):
            return list(self._client.mget_nonatomic(full) if self._cluster else self._client.mget(full))

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        if not items:
            return
        with self._translate("pipelined SET"):
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self._prefix + key, value)
            pipe.execute()

    def _exists_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        with self._translate("pipelined EXISTS"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._prefix + key)
            return [bool(n) for n in pipe.execute()]

    def _keys(self, prefix: str) -> Iterator[str]:
        pattern = _glob_escape(self._prefix + prefix) + "*"
        with self._translate("SCAN"):
            for raw in self._client.scan_iter(match=pattern, count=_SCAN_BATCH):
                yield raw.decode("ascii", "replace")[len(self._prefix) :]

    def _close(self) -> None:
        with suppress(Exception):  # closing a client whose server is gone must not raise
            self._client.close()

    @contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """Turn redis-py's exceptions into the store family, naming the server but never its password."""
        try:
            yield
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"{what} on {self.url} failed: {type(exc).__name__}: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreError(f"{what} on {self.url} failed: {type(exc).__name__}: {exc}") from exc


def check_url(url: str) -> None:
    """Refuse what opening ``url`` would refuse for its form (our options and redis-py's), without connecting."""
    redis_url = _settings(url)[0]
    try:
        parse_url(redis_url)  # what the client's pool does with it, short of a connection
    except ValueError as exc:
        raise StoreURLError(f"{redact_url(url)}: {exc}") from None


def _settings(url: str) -> tuple[str, bool, str, int, dict[str, float]]:
    """redis-py's URL (our options taken out), whether it names a cluster, the key prefix, retries and timeouts."""
    base, options = split_query(url)
    cluster = base.split("://", 1)[0].endswith("+cluster")
    prefix, retries, timeouts = _own_options(options, url)
    return with_query(base.replace("+cluster://", "://", 1), options), cluster, prefix, retries, timeouts


def _own_options(options: dict[str, str], url: str) -> tuple[str, int, dict[str, float]]:
    """Pop the options this module handles, leaving redis-py's own in ``options``."""
    reject_unknown(options, _OWN | _PASSED_THROUGH, url)
    prefix = validate_prefix(options.pop("prefix", ""))
    retries = parse_int("retries", options.pop("retries", str(DEFAULT_RETRIES)))
    for alias, name in _ALIASES.items():
        if alias in options:
            if name in options:
                raise StoreURLError(f"give {alias} or {name}, not both, in {redact_url(url)}")
            options[name] = options.pop(alias)
    timeouts = {"socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT, "socket_timeout": DEFAULT_READ_TIMEOUT}
    for name in _TIMEOUTS & set(options):
        timeouts[name] = parse_float(name, options.pop(name), minimum=0.001)
    return prefix, retries, timeouts


def _make_client(url: str, cluster: bool, retries: int, timeouts: dict[str, float]) -> Any:
    retry = Retry(NoBackoff(), retries, supported_errors=(redis.ConnectionError,))
    if cluster:
        return RedisCluster.from_url(url, retry=retry, **timeouts)
    pool = redis.ConnectionPool.from_url(url, retry=retry, **timeouts)
    return redis.Redis(connection_pool=pool)


def _glob_escape(text: str) -> str:
    """Escape SCAN MATCH metacharacters so a key prefix is matched literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
