"""``open_store(url)``: a table of URL schemes, each naming where its store is built (imported on first use).

In the manner of fsspec's ``known_implementations``: a scheme maps to a
``module:function`` that takes the URL and returns a :class:`~storage.base.Store`,
so optional backends (redis-py, the Mooncake client) are imported only when a
URL asks for them, and a missing one is a clear error naming its extra. A
*wrapper* scheme (``link+``, ``faults+``) takes another store's URL after its
``+`` and wraps that store. Each scheme also names its ``check``: a function
that refuses what opening the URL would refuse for its form (every option and
its value, a wrapped store's URL), without connecting or touching anything.
Configuration validation and every error message ask this table
(:func:`check_url`, :func:`describe_schemes`), so what is accepted lives in
one place, and a misspelled option stops ``kvcodec serve`` before vLLM
starts rather than the engine 30 s later.

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
from typing import Any

from storage.base import Store
from storage.errors import StoreURLError
from storage.options import redact_url
from storage.read_only import ReadOnlyStore

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    factory: str  # "module:function"; a wrapper's function also takes open_store
    check: str  # "module:function" refusing a bad URL without opening it; a wrapper's also takes check_url
    example: str
    extra: str = ""  # the pip extra that brings the backend's library
    wrapper: bool = False
    needs: str = ""  # what else the backend's library needs, for the error when it cannot be imported
    read_only_option: bool = False  # the factory takes read_only=True (then it creates nothing on open)


SCHEMES: dict[str, Scheme] = {}
_REDIS, _REDIS_CHECK = "storage.redis_store:RedisStore", "storage.redis_store:check_url"


def register_scheme(scheme: Scheme) -> None:
    SCHEMES[scheme.name] = scheme


for _s in (
    Scheme("file", "storage.file_store:from_url", "storage.file_store:check_url", "file:///path",
           read_only_option=True),
    Scheme("memory", "storage.memory_store:from_url", "storage.memory_store:check_url", "memory://name"),
    Scheme("redis", _REDIS, _REDIS_CHECK, "redis://host:6379/0", "redis"),
    Scheme("rediss", _REDIS, _REDIS_CHECK, "rediss://host:6380/0", "redis"),
    Scheme("redis+cluster", _REDIS, _REDIS_CHECK, "redis+cluster://host:7000", "redis"),
    Scheme("rediss+cluster", _REDIS, _REDIS_CHECK, "rediss+cluster://host:7000", "redis"),
    Scheme("mooncake", "storage.mooncake_store:MooncakeStore", "storage.mooncake_options:check_url",
           "mooncake://master:50051?metadata=...", "mooncake", needs="Debian's libibverbs1, even for TCP"),
    Scheme("link", "storage.testing.link:from_url", "storage.testing.link:check_url", "link+<url>?gbps=10&rtt_ms=0.2",
           wrapper=True),
    Scheme("faults", "storage.testing.faults:from_url", "storage.testing.faults:check_url",
           "faults+<url>?seed=1&drop=0.1", wrapper=True),
    Scheme("cache", "storage.near_tier:from_url", "storage.near_tier:check_url",
           "cache+<url>?near=file:///nvme/kv&near_bytes=200G", wrapper=True),
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
    """``url``, if opening it would not be refused for its form; raises StoreURLError naming what is wrong.

    Nothing is opened, connected, resolved or created: a store that is down
    or a directory that does not exist yet passes.
    """
    scheme = scheme_of(url)
    check = _function(scheme, scheme.check, url)
    if scheme.wrapper:
        check(url, check_url)
    else:
        check(url)
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
    factory = _function(scheme, scheme.factory, url)
    if scheme.wrapper:
        store = factory(url, functools.partial(open_store, read_only=True) if read_only else open_store)
    elif read_only and scheme.read_only_option:
        store = factory(url, read_only=True)
    else:
        store = factory(url)
    return ReadOnlyStore(store) if read_only else store


def _function(scheme: Scheme, target: str, url: str) -> Callable[..., Any]:
    """The ``module:function`` ``target`` of ``scheme``, imported now; a missing library names its extra."""
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        hint = f": pip install 'vllm-kvcodec[{scheme.extra}]'" if scheme.extra else ""
        hint += f" (and {scheme.needs})" if scheme.needs else ""
        raise StoreURLError(f"{redact_url(url)} needs a library that is not installed{hint} ({exc})") from None
