"""``open_store(url)``: one string chooses and configures a store.

URL forms:

- ``file:///abs/path`` (also ``file:relative/path``): the embedded default;
  options ``max_bytes`` (LRU size cap, e.g. ``10GiB``), ``fsync`` (bool).
- ``memory://`` (private) or ``memory://name`` (shared within the process).
- ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS),
  ``redis+cluster://``, ``rediss+cluster://``; options in :mod:`storage.redis_store`.
- ``mooncake://master_host:port?metadata=...&segment=...``: a Mooncake Store
  pool; options in :mod:`storage.mooncake_options`.
- ``link+<any of the above>?gbps=G&rtt_ms=R``: the store behind an emulated
  network link (:mod:`storage.testing.link`).
- ``faults+<any of the above>?seed=S&drop=P&truncate=P&corrupt=P&delay=P&delay_s=D&swap=P&down=0``:
  the store behind seeded fault injection, for tests (:mod:`storage.testing.faults`).

Backends are imported on demand, so ``redis`` and ``mooncake`` stay optional dependencies.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from storage.base import Store
from storage.errors import StoreURLError
from storage.options import (
    parse_bool,
    parse_float,
    parse_int,
    parse_size,
    redact_url,
    reject_unknown,
    split_query,
    with_query,
)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_REDIS_SCHEMES = {"redis", "rediss", "redis+cluster", "rediss+cluster"}


def open_store(url: str) -> Store:
    """Open the store ``url`` names; raises StoreURLError for a malformed URL."""
    if not isinstance(url, str) or not _SCHEME.match(url):
        raise StoreURLError(f"{url!r} is not a store URL such as file:///path, redis://host:6379/0 or memory://")
    scheme = url.split(":", 1)[0].lower()
    if scheme.startswith("link+"):
        return _open_link(url)
    if scheme.startswith("faults+"):
        return _open_faults(url)
    if scheme == "file":
        return _open_file(url)
    if scheme == "memory":
        return _open_memory(url)
    if scheme in _REDIS_SCHEMES:
        return _open_redis(url)
    if scheme == "mooncake":
        return _open_mooncake(url)
    raise StoreURLError(
        f"unknown store scheme {scheme!r} in {redact_url(url)}; "
        "use file://, memory://, redis://, rediss://, redis+cluster://, mooncake://, link+<url> or faults+<url>"
    )


def _open_file(url: str) -> Store:
    from storage.file_store import FileStore

    base, options = split_query(url)
    reject_unknown(options, {"max_bytes", "fsync"}, url)
    parts = urlsplit(base)
    if parts.netloc not in ("", "localhost"):
        raise StoreURLError(f"file URLs name a local path (file:///abs/path), not host {parts.netloc!r}")
    path = unquote(parts.path)
    if not path:
        raise StoreURLError(f"{url!r} names no directory")
    max_bytes = parse_size("max_bytes", options["max_bytes"]) if "max_bytes" in options else None
    fsync = parse_bool("fsync", options.get("fsync", "0"))
    return FileStore(path, max_bytes=max_bytes, fsync=fsync)


def _open_memory(url: str) -> Store:
    from storage.memory_store import MemoryStore

    base, options = split_query(url)
    reject_unknown(options, set(), url)
    parts = urlsplit(base)
    return MemoryStore(unquote(parts.netloc + parts.path))


def _open_redis(url: str) -> Store:
    try:
        from storage.redis_store import RedisStore
    except ImportError as exc:
        raise StoreURLError(f"{redact_url(url)} needs redis-py: pip install 'vllm-kvcodec[redis]' ({exc})") from None
    return RedisStore(url)


def _open_mooncake(url: str) -> Store:
    try:
        from storage.mooncake_store import MooncakeStore
    except ImportError as exc:
        raise StoreURLError(
            f"{redact_url(url)} needs the Mooncake client: pip install 'vllm-kvcodec[mooncake]' "
            f"(and Debian's libibverbs1) ({exc})"
        ) from None
    return MooncakeStore(url)


def _open_link(url: str) -> Store:
    from storage.testing.link import LinkEmulator

    base, options = split_query(url[len("link+") :])
    missing = {"gbps"} - set(options)
    if missing:
        raise StoreURLError(f"{redact_url(url)} needs gbps=<Gbit/s> (and optionally rtt_ms=<ms>)")
    gbps = parse_float("gbps", options.pop("gbps"), minimum=1e-9)
    rtt_ms = parse_float("rtt_ms", options.pop("rtt_ms", "0"))
    inner = open_store(with_query(base, options))
    return LinkEmulator(inner, gbps=gbps, rtt_ms=rtt_ms)


def _open_faults(url: str) -> Store:
    from storage.testing.faults import FAULT_KINDS, FaultInjector

    base, options = split_query(url[len("faults+") :])
    rates = {k: parse_float(k, options.pop(k)) for k in FAULT_KINDS if k in options}
    seed = parse_int("seed", options.pop("seed", "0"))
    delay_s = parse_float("delay_s", options.pop("delay_s", "1"))
    down = parse_bool("down", options.pop("down", "0"))
    if any(p > 1 for p in rates.values()) or sum(rates.values()) > 1 + 1e-9:
        raise StoreURLError(f"fault probabilities in {redact_url(url)} must each be <= 1 and sum to at most 1")
    inner = open_store(with_query(base, options))
    return FaultInjector(inner, seed=seed, delay_s=delay_s, down=down, **rates)
