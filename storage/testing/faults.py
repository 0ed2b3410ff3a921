"""A store that misbehaves on purpose: seeded faults on reads, and an outage switch.

Why: the connector promises "never wrong tokens, never a hang" whatever the
store does. Proving it needs a store that does the bad things real ones do,
at rates high enough to see them in a short test, reproducibly.

What it does, on reads (``get``, ``get_many``) of a value that exists, each
read independently, with the probabilities given:

``drop``
    the value is reported missing (``None``): evicted between lookup and load.
``truncate``
    a strict prefix of the value comes back (a torn write, a cut connection).
``corrupt``
    1 to 3 bits are flipped, half the time in the first 64 bytes (the chunk
    header), else anywhere (bit rot, a bad NIC).
``delay``
    the right value comes back after ``delay_s`` seconds (an overloaded store),
    meant to exceed the reader's timeout.
``swap``
    the value of another key comes back, preferably one with the same last key
    segment (the same layer group, so the same shape): intact, with a valid
    checksum, just not what was asked for. The stored objects are not moved.

At most one fault per read. The choice is a function of ``seed``, the key and
how many times this wrapper has read that key, so a run is reproducible
whatever order threads read in (a swap's partner is drawn from the keys this
wrapper has seen written or read, sorted, so it also depends on those). Misses stay misses. ``exists`` and ``put``
(and every other operation) pass through untouched, so lookups find what was
saved and the faults land on the load path, where they must be caught.

:meth:`FaultInjector.down` takes the store down: every operation then raises
:class:`~storage.errors.StoreUnavailableError` at once until :meth:`up`.

:attr:`FaultInjector.injected` counts the faults by kind (and ``down`` for
calls refused while down); :attr:`FaultInjector.reads` counts values read;
:meth:`FaultInjector.calls_by_op` counts the calls of each operation (``get``,
``get_many``, ``exists_many``, ``put`` ...), refused ones included, so a test
can tell which reads its faults could have landed on (a load's batch, a
lookup's block refs, a probe).

From a URL, prefix any store URL with ``faults+`` and add the options:
``faults+file:///tmp/kv?seed=1&drop=0.1&truncate=0.1&corrupt=0.1&delay=0.05&delay_s=2&swap=0.05``
(``down=1`` starts it down). Or as a class: ``FaultInjector(store, seed=1, corrupt=0.2)``.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from storage.base import Store
from storage.errors import StoreUnavailableError, StoreURLError
from storage.options import parse_bool, parse_float, parse_int, redact_url, split_query, with_query

FAULT_KINDS = ("drop", "truncate", "corrupt", "delay", "swap")
HEADER_BYTES = 64
_MAX_SWAP_CANDIDATES = 256  # keys remembered per last segment
_T = TypeVar("_T")


class FaultInjector(Store):
    def __init__(
        self,
        store: Store,
        *,
        seed: int = 0,
        drop: float = 0.0,
        truncate: float = 0.0,
        corrupt: float = 0.0,
        delay: float = 0.0,
        swap: float = 0.0,
        delay_s: float = 1.0,
        down: bool = False,
    ) -> None:
        rates = {"drop": drop, "truncate": truncate, "corrupt": corrupt, "delay": delay, "swap": swap}
        if any(not 0.0 <= p <= 1.0 for p in rates.values()) or sum(rates.values()) > 1.0 + 1e-9:
            raise ValueError(f"fault probabilities must each be in [0, 1] and sum to at most 1, got {rates}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        super().__init__(_faults_url(store.url, seed, rates, delay_s))
        self.inner = store
        self.seed, self.rates, self.delay_s = seed, rates, delay_s
        self.injected: collections.Counter[str] = collections.Counter()
        self.reads = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self._down = down
        self._lock = threading.Lock()
        self._read_count: collections.Counter[str] = collections.Counter()
        self._seen: dict[str, list[str]] = collections.defaultdict(list)

    # -- the outage switch --------------------------------------------------

    def down(self) -> None:
        """From now on every operation raises StoreUnavailableError, at once."""
        self._down = True

    def up(self) -> None:
        self._down = False

    @property
    def is_down(self) -> bool:
        return self._down

    def counts(self) -> dict[str, int]:
        """Faults injected so far by kind (every kind present, zeros included) and ``reads``."""
        with self._lock:
            return {**{k: self.injected[k] for k in (*FAULT_KINDS, "down")}, "reads": self.reads}

    def calls_by_op(self) -> dict[str, int]:
        """Calls so far per store operation (only those made), refused ones included."""
        with self._lock:
            return dict(self.calls)

    # -- the store protocol ---------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        value = self._call("get", lambda: self.inner.get(key))
        return self._fault(key, value)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        values = self._call("get_many", lambda: self.inner.get_many(keys))
        return [self._fault(k, v) for k, v in zip(keys, values)]

    def _put(self, key: str, value: memoryview) -> None:
        self._call("put", lambda: self.inner.put(key, value))
        self._remember(key)

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        self._call("put_many", lambda: self.inner.put_many(items))
        for key, _ in items:
            self._remember(key)

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        written = self._call("replace", lambda: self.inner.replace(key, expected, value))
        self._remember(key)
        return written

    def _exists(self, key: str) -> bool:
        return self._call("exists", lambda: self.inner.exists(key))

    def _exists_many(self, keys: list[str]) -> list[bool]:
        return self._call("exists_many", lambda: self.inner.exists_many(keys))

    def _delete(self, key: str) -> None:
        self._call("delete", lambda: self.inner.delete(key))

    def _keys(self, prefix: str) -> Iterator[str]:
        return self._call("keys", lambda: self.inner.keys(prefix))

    def _close(self) -> None:
        self.inner.close()

    # -- the faults -------------------------------------------------------------

    def _call(self, name: str, op: Callable[[], _T]) -> _T:
        with self._lock:
            self.calls[name] += 1
        if self._down:
            with self._lock:
                self.injected["down"] += 1
            raise StoreUnavailableError(f"{self.url} is down (fault injection)")
        return op()

    def _fault(self, key: str, value: bytes | None) -> bytes | None:
        if value is None:
            return None
        self._remember(key)
        with self._lock:
            self.reads += 1
            n = self._read_count[key]
            self._read_count[key] += 1
        rng = random.Random(f"{self.seed}/{key}/{n}")  # str seeds hash with SHA-512: stable everywhere
        kind = self._choose(rng.random())
        if kind is None:
            return value
        if kind != "swap":  # counted before it acts, so a delay shows while it is happening
            self._count(kind)
        faulty = getattr(self, f"_{kind}")(rng, key, value)
        if kind == "swap" and faulty is not value:  # a swap with nothing to swap with did nothing
            self._count(kind)
        return faulty

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def _choose(self, u: float) -> str | None:
        for kind in FAULT_KINDS:
            u -= self.rates[kind]
            if u < 0:
                return kind
        return None

    def _drop(self, rng: random.Random, key: str, value: bytes) -> bytes | None:
        return None

    def _truncate(self, rng: random.Random, key: str, value: bytes) -> bytes:
        return value[: rng.randrange(len(value))]

    def _corrupt(self, rng: random.Random, key: str, value: bytes) -> bytes:
        out = bytearray(value)
        for _ in range(rng.randint(1, 3)):
            span = min(len(out), HEADER_BYTES) if rng.random() < 0.5 else len(out)
            out[rng.randrange(span)] ^= 1 << rng.randrange(8)
        return bytes(out)

    def _delay(self, rng: random.Random, key: str, value: bytes) -> bytes:
        time.sleep(self.delay_s)
        return value

    def _swap(self, rng: random.Random, key: str, value: bytes) -> bytes:
        with self._lock:
            same = sorted(k for k in self._seen.get(_last_segment(key), ()) if k != key)
            others = same or sorted(k for ks in self._seen.values() for k in ks if k != key)
        while others:
            other = others.pop(rng.randrange(len(others)))
            swapped = self.inner.get(other)
            if swapped is not None and swapped != value:
                return swapped
        return value  # nothing to swap with: no fault

    def _remember(self, key: str) -> None:
        with self._lock:
            seen = self._seen[_last_segment(key)]
            if len(seen) < _MAX_SWAP_CANDIDATES and key not in seen:
                seen.append(key)


def find_fault_injector(store: Store) -> FaultInjector | None:
    """The FaultInjector in a chain of wrappers (``.inner`` links), if there is one."""
    while store is not None and not isinstance(store, FaultInjector):
        store = getattr(store, "inner", None)
    return store


def _last_segment(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _faults_url(inner: str, seed: int, rates: dict[str, float], delay_s: float) -> str:
    sep = "&" if "?" in inner else "?"
    options = "&".join(f"{k}={v:g}" for k, v in rates.items() if v)
    return f"faults+{inner}{sep}seed={seed}{'&' + options if options else ''}&delay_s={delay_s:g}"


def from_url(url: str, open_inner: Callable[[str], Store]) -> FaultInjector:
    """``faults+<store url>?seed=S&drop=P&truncate=P&corrupt=P&delay=P&delay_s=D&swap=P&down=0``."""
    inner, settings = _settings(url)
    return FaultInjector(open_inner(inner), **settings)


def check_url(url: str, check_inner: Callable[[str], object]) -> None:
    """Refuse what :func:`from_url` would refuse, the inner store's URL included, without opening anything."""
    check_inner(_settings(url)[0])


def _settings(url: str) -> tuple[str, dict]:
    """The inner store's URL, and the injector's keyword arguments."""
    base, options = split_query(url[len("faults+") :])
    rates = {k: parse_float(k, options.pop(k)) for k in FAULT_KINDS if k in options}
    seed = parse_int("seed", options.pop("seed", "0"))
    delay_s = parse_float("delay_s", options.pop("delay_s", "1"))
    down = parse_bool("down", options.pop("down", "0"))
    if any(p > 1 for p in rates.values()) or sum(rates.values()) > 1 + 1e-9:
        raise StoreURLError(f"fault probabilities in {redact_url(url)} must each be <= 1 and sum to at most 1")
    return with_query(base, options), {"seed": seed, "delay_s": delay_s, "down": down, **rates}
