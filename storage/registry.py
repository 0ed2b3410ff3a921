"""``open_store(url)``: a table of URL schemes, each naming where its store is built (imported on first use).

In the manner of fsspec's ``known_implementations``: a scheme maps to a
``module:function`` that takes the URL and returns a :class:`~storage.base.Store`,
so optional backends (redis-py, the Mooncake client) are imported only when a
URL asks for them, and a missing one is a clear error naming its extra. A
*wrapper* scheme (``link+``, ``faults+``) takes another store's URL after its
``+`` and wraps that store. Configuration validation and every error message
ask this table (:func:`check_url`, :func:`describe_schemes`), so the list of
what is accepted lives in one place.

Schemes:

- ``file:///abs/path`` (also ``file:relative/path``): the embedded default;
  options ``max_bytes`` (LRU size cap, e.g. ``10GiB``), ``fsync`` (bool).
- ``memory://`` (private) or ``memory://name`` (shared within the process).
- ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS),
  ``redis+cluster://``, ``rediss+cluster://``; options in :mod:`storage.redis_store`.
- ``mooncake://master_host:port?metadata=...&segment=...``: a Mooncake Store
  pool; options in :mod:`storage.mooncake_options`.
- ``link+<url>?gbps=G&rtt_ms=R``: the store behind an emulated network link
  (:mod:`storage.testing.link`, for benchmarks).
- ``faults+<url>?seed=S&drop=P&truncate=P&corrupt=P&delay=P&delay_s=D&swap=P&down=0``:
  the store behind seeded fault injection (:mod:`storage.testing.faults`, for tests).
- ``cache+<url>?near=file:///nvme/kv&near_bytes=200G`` (or ``near=memory://``): the
  store (far) behind a near tier on this host (:mod:`storage.near_tier`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable

from storage.base import Store
from storage.errors import StoreURLError
from storage.options import redact_url
from storage.read_only import ReadOnlyStore

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    factory: str  # "module:function"; a wrapper's function also takes open_store
    example: str
    extra: str = ""  # the pip extra that brings the backend's library
    wrapper: bool = False
    needs: str = ""  # what else the backend's library needs, for the error when it cannot be imported
    read_only_option: bool = False  # the factory takes read_only=True (then it creates nothing on open)


SCHEMES: dict[str, Scheme] = {}


def register_scheme(scheme: Scheme) -> None:
    SCHEMES[scheme.name] = scheme


for _s in (
    Scheme("file", "storage.file_store:from_url", "file:///path", read_only_option=True),
    Scheme("memory", "storage.memory_store:from_url", "memory://name"),
    Scheme("redis", "storage.redis_store:RedisStore", "redis://host:6379/0", "redis"),
    Scheme("rediss", "storage.redis_store:RedisStore", "rediss://host:6380/0", "redis"),
    Scheme("redis+cluster", "storage.redis_store:RedisStore", "redis+cluster://host:7000", "redis"),
    Scheme("rediss+cluster", "storage.redis_store:RedisStore", "rediss+cluster://host:7000", "redis"),
    Scheme("mooncake", "storage.mooncake_store:MooncakeStore", "mooncake://master:50051?metadata=...", "mooncake",
           needs="Debian's libibverbs1, even for TCP"),
    Scheme("link", "storage.testing.link:from_url", "link+<url>?gbps=10&rtt_ms=0.2", wrapper=True),
    Scheme("faults", "storage.testing.faults:from_url", "faults+<url>?seed=1&drop=0.1", wrapper=True),
    Scheme("cache", "storage.near_tier:from_url", "cache+<url>?near=file:///nvme/kv&near_bytes=200G", wrapper=True),
):
    register_scheme(_s)


def describe_schemes() -> str:
    """Every accepted URL form, for error messages and help texts."""
    return ", ".join(s.example for s in SCHEMES.values())


def scheme_of(url: str) -> Scheme:
    """The scheme ``url`` names (for a wrapper, the wrapper); raises StoreURLError if it is not in the table."""
    if not isinstance(url, str) or not _SCHEME.match(url):
        raise StoreURLError(f"{url!r} is not a store URL; use one of: {describe_schemes()}")
    name = url.split(":", 1)[0].lower()
    for wrapper in (s for s in SCHEMES.values() if s.wrapper):
        if name.startswith(wrapper.name + "+"):
            return wrapper
    scheme = SCHEMES.get(name)
    if scheme is None or scheme.wrapper:
        raise StoreURLError(f"unknown store scheme {name!r} in {redact_url(url)}; use one of: {describe_schemes()}")
    return scheme


def check_url(url: str) -> str:
    """Validate the scheme of ``url`` (and of whatever a wrapper wraps) without opening anything."""
    scheme = scheme_of(url)
    if scheme.wrapper:
        check_url(url[len(scheme.name) + 1 :])
    return url


def reads_in_memory(url: str) -> bool:
    """What :attr:`Store.reads_in_memory` of the store ``url`` names says, from the URL alone.

    Why: the connector shapes its keys by it (one object per chunk where
    loads are memory copies that wait whole), and its scheduler half must
    agree with its worker half before either has reached the store. A
    wrapper says no: ``link+`` emulates a network, ``faults+`` is for tests.
    """
    scheme = scheme_of(url)
    if scheme.name == "cache":  # answers as its far store does: keys must match the fleet's
        from storage.near_tier import far_url

        return reads_in_memory(far_url(url))
    if scheme.name == "memory":
        return True
    if scheme.name == "file":
        from storage.file_store import reads_in_memory_at

        return reads_in_memory_at(url)
    return False


def open_store(url: str, *, read_only: bool = False) -> Store:
    """Open the store ``url`` names; raises StoreURLError for a malformed URL or an unknown scheme.

    ``read_only``: writes raise, and nothing is created on open (a file store
    whose directory does not exist is a StoreUnavailableError, not a new empty
    store); a wrapper's inner store is opened read-only as well.
    """
    scheme = scheme_of(url)
    factory = _factory(scheme, url)
    if scheme.wrapper:
        store = factory(url, functools.partial(open_store, read_only=True) if read_only else open_store)
    elif read_only and scheme.read_only_option:
        store = factory(url, read_only=True)
    else:
        store = factory(url)
    return ReadOnlyStore(store) if read_only else store


def _factory(scheme: Scheme, url: str) -> Callable[..., Store]:
    module, _, name = scheme.factory.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        hint = f": pip install 'vllm-kvcodec[{scheme.extra}]'" if scheme.extra else ""
        hint += f" (and {scheme.needs})" if scheme.needs else ""
        raise StoreURLError(f"{redact_url(url)} needs a library that is not installed{hint} ({exc})") from None
