"""``cache+<far url>?near=<near url>&near_bytes=32G``: a local near tier in front of a shared (far) store.

Why: in a fleet the far store (Redis, Mooncake, a file store on NFS) is remote,
so an instance that serves the same system prompt a thousand times an hour
would fetch it a thousand times, and every instance's hits load the far store.
A near tier on this host (``memory://`` or a ``file://`` directory on local
NVMe) keeps the compressed objects it has read or written, within a byte cap,
so hot prefixes cross the network once.

Reads ask the near tier first and fill it on a far hit (the compressed object,
so the near tier holds 1.4-1.5x more KV than raw). ``exists_many`` asks the near
tier first and the far store only for the keys the near tier lacks.

Writes go to both. The near write is done before ``put`` returns; the far write
runs on background threads with a bounded queue (``far_queue_bytes``), so
``put`` waits for the far store only when that queue is full (back-pressure, so
the connector's saver budget, not this tier, decides what is dropped). So a
returned ``put`` means: readable here now, and on its way to the far store. A
far write that fails is counted (``far_write_failures``) and its near copy is
deleted: the near tier never holds an object the far store refused, and a later
lookup misses (the chunk is recomputed and saved again), never loads something
the rest of the fleet cannot see. :meth:`NearTier.flush` waits for the queue;
``close`` waits up to ``flush_s`` seconds and says how many writes it dropped.
A conditional write (``replace``) is the far store's own, made at once, and
drops the near copy.

Integrity: each near copy carries an 8-byte XXH3-64 trailer over its key and
value, checked on every near read. A damaged near copy (bit rot, a file torn by
a crash without fsync, a hand edit) is deleted, counted (``near_damaged``) and
read from the far store in the same call, so the caller never sees it. A read
in place (``open_ranged``, the file store's ``preadv`` into KV pages) checks
the trailer as the reader's bytes go by; when the last byte shows damage, the
read raises :class:`StoreError` (that load is recomputed) and the copy is
deleted, so the next read goes to the far store.

Eviction: a ``file://`` near tier is a file store capped at ``near_bytes``
(its multi-process LRU, :mod:`storage.file_cap`); any other near store gets an
in-process LRU index here. Far errors on reads propagate (the connector's
outage guard handles them; see docs/tiers.md for what that means for near hits
during a far outage).

Options: ``near`` (required; a ``file://`` or ``memory://`` URL, percent-encoded
if it has its own query), ``near_bytes`` (required; a size), ``far_queue_bytes``
(default 256MiB), ``far_threads`` (default 2), ``flush_s`` (default 30).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, unquote

from storage.base import Store
from storage.errors import StoreError, StoreURLError
from storage.options import parse_float, parse_int, parse_size, redact_url, reject_unknown, split_query, with_query
from storage.ranged import TRAILER_BYTES, BytesRange, CheckedRange, RangedValue, seal, unseal

logger = logging.getLogger("vllm_kvcodec")

NEAR_SCHEMES = ("file", "memory")
DEFAULT_FAR_QUEUE_BYTES = 256 << 20
COUNTER_NAMES = ("near_hits", "near_misses", "near_read_bytes", "near_fills", "near_fill_failures", "near_evictions",
                 "near_damaged", "near_write_failures", "far_reads", "far_read_bytes", "far_lookups",
                 "far_writes", "far_write_bytes", "far_write_failures", "far_queue_waits")
_LOG_INTERVAL_S = 10.0


class NearTier(Store):
    """``far`` behind ``near``: reads near first, writes both (far in the background), counted per tier."""

    def __init__(self, far: Store, near: Store, near_bytes: int, *, self_capped: bool = False,
                 far_queue_bytes: int = DEFAULT_FAR_QUEUE_BYTES, far_threads: int = 2, flush_s: float = 30.0,
                 evictions: Callable[[], int] | None = None) -> None:
        """``self_capped``: ``near`` evicts within ``near_bytes`` itself (a capped file store; ``evictions`` reads
        its count); otherwise this tier keeps an LRU index of what it put there."""
        sep = "&" if "?" in far.url else "?"
        super().__init__(f"cache+{far.url}{sep}near={quote(near.url, safe=':/')}&near_bytes={near_bytes}")
        self.inner, self.near = far, near  # .inner: the far store, for tools that walk wrapper chains
        self.near_bytes, self.far_queue_bytes, self.flush_s = near_bytes, far_queue_bytes, flush_s
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._index: collections.OrderedDict[str, int] | None = None if self_capped else collections.OrderedDict()
        self._indexed = 0
        self._near_evictions = evictions
        self._queue = threading.Condition(self._lock)
        self._queued_bytes = 0
        self._queued = 0
        self._writers = ThreadPoolExecutor(far_threads, thread_name_prefix="kvcodec-far-write")
        self._last_warning = -_LOG_INTERVAL_S

    # -- what the connector and tests read -------------------------------------------

    def tier_counters(self) -> dict[str, int]:
        """Cumulative counts per tier (every name in COUNTER_NAMES); the connector reports their growth."""
        with self._lock:
            out = {name: self._counts[name] for name in COUNTER_NAMES}
        if self._near_evictions is not None:
            out["near_evictions"] += self._near_evictions()
        return out

    @property
    def reads_in_memory(self) -> bool:
        """The far store's answer: the connector shapes its keys by it, and they must match the fleet's."""
        return self.inner.reads_in_memory

    @property
    def ranged_reads(self) -> bool:
        """A file near tier keeps the file store's reads in place (near misses come as bytes)."""
        return self.near.ranged_reads

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued far write is done; True if none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue:
            while self._queued:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._queue.wait(remaining)
        return True

    # -- reads -------------------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        return self._get_many([key])[0]

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        values = self._near_values(keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            far = self.inner.get_many([keys[i] for i in missing])
            for i, value in zip(missing, far):
                values[i] = value
            found = [(keys[i], v) for i, v in zip(missing, far) if v is not None]
            self._add(far_reads=len(found), far_read_bytes=sum(len(v) for _, v in found))
            self._fill(found)
        return values

    def _near_values(self, keys: list[str]) -> list[bytes | None]:
        """What the near tier holds intact (damaged copies dropped); a near that fails is a miss."""
        try:
            sealed = self.near.get_many(keys)
        except StoreError as exc:
            self._warn("near tier read failed, reading the far store: %s", exc)
            sealed = [None] * len(keys)
        values: list[bytes | None] = []
        for key, blob in zip(keys, sealed):
            value = None if blob is None else unseal(key, blob)
            if blob is not None and value is None:
                self._damaged(key)
            values.append(value)
        hits = [v for v in values if v is not None]
        self._add(near_hits=len(hits), near_misses=len(keys) - len(hits), near_read_bytes=sum(len(v) for v in hits))
        self._touch(k for k, v in zip(keys, values) if v is not None)
        return values

    def _open_ranged(self, key: str) -> RangedValue | None:
        if self.near.ranged_reads:
            try:
                value = self.near.open_ranged(key)
            except StoreError as exc:  # no valid header: a damaged copy
                self._warn("near tier copy of %s unreadable, dropped: %s", key, exc)
                self._damaged(key)
                value = None
            if value is not None:
                if value.size >= TRAILER_BYTES:
                    self._add(near_hits=1, near_read_bytes=value.size - TRAILER_BYTES)
                    self._touch([key])
                    return CheckedRange(value, key, self._damaged)
                value.close()
                self._damaged(key)
            self._add(near_misses=1)
        else:
            return None if (blob := self._get(key)) is None else BytesRange(blob)
        blob = self.inner.get(key)
        if blob is None:
            return None
        self._add(far_reads=1, far_read_bytes=len(blob))
        self._fill([(key, blob)])
        return BytesRange(blob)

    def _exists(self, key: str) -> bool:
        return self._exists_many([key])[0]

    def _exists_many(self, keys: list[str]) -> list[bool]:
        try:
            found = self.near.exists_many(keys)
        except StoreError as exc:  # a near tier that fails is empty: the far store answers
            self._warn("near tier lookup failed, asking the far store: %s", exc)
            found = [False] * len(keys)
        lacking = [i for i, ok in enumerate(found) if not ok]
        if lacking:
            self._add(far_lookups=len(lacking))
            for i, ok in zip(lacking, self.inner.exists_many([keys[i] for i in lacking])):
                found[i] = ok
        return found

    def _keys(self, prefix: str) -> Iterator[str]:
        return self.inner.keys(prefix)

    # -- writes ------------------------------------------------------------------------

    def _put(self, key: str, value: memoryview) -> None:
        self._put_many([(key, value)])

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        owned = [(k, v if isinstance(v.obj, bytes) else memoryview(v.tobytes())) for k, v in items]
        nbytes = sum(v.nbytes for _, v in owned)
        self._reserve(nbytes)  # before the near write: a full queue must not fill the near tier past the far one
        self._fill(owned, counted=False)
        self._writers.submit(self._write_far, owned, nbytes)

    def _reserve(self, nbytes: int) -> None:
        """Wait until the far queue has room for ``nbytes`` (always for a lone write larger than the queue)."""
        with self._queue:
            if self._queued_bytes and self._queued_bytes + nbytes > self.far_queue_bytes:
                self._counts["far_queue_waits"] += 1
                while self._queued_bytes and self._queued_bytes + nbytes > self.far_queue_bytes:
                    self._queue.wait()
            self._queued_bytes += nbytes
            self._queued += 1

    def _write_far(self, items: list[tuple[str, memoryview]], nbytes: int) -> None:
        try:
            self.inner.put_many(items)
            self._add(far_writes=len(items), far_write_bytes=nbytes)
        except Exception as exc:  # noqa: BLE001 - counted, and the near copies go: never hold what the far refused
            self._add(far_write_failures=len(items))
            self._warn("far store write of %d object(s) failed; dropped from the near tier too: %s", len(items), exc)
            for key, _ in items:
                self._drop_near(key)
        finally:
            with self._queue:
                self._queued_bytes -= nbytes
                self._queued -= 1
                self._queue.notify_all()

    def _replace(self, key: str, expected: memoryview, value: memoryview) -> bool:
        """The far store's conditional write, at once (not queued); the near copy is dropped either way, so the next
        read takes whatever the far store holds now (a queued put of this key may still land after it)."""
        written = self.inner.replace(key, expected, value)
        self._drop_near(key)
        return written

    def _delete(self, key: str) -> None:
        self._drop_near(key)
        self.inner.delete(key)

    # -- the near tier -------------------------------------------------------------------

    def _fill(self, items: Sequence[tuple[str, memoryview | bytes]], counted: bool = True) -> None:
        """Put sealed copies near (a failure is counted, never raised: the far store has the truth)."""
        for key, value in items:
            sealed = seal(key, value)
            if self._index is not None and len(sealed) > self.near_bytes:
                self._add(near_fill_failures=1)
                continue
            try:
                self.near.put(key, sealed)
            except StoreError as exc:
                self._add(**{"near_fill_failures" if counted else "near_write_failures": 1})
                self._warn("near tier write of %s failed: %s", key, exc)
                continue
            if counted:
                self._add(near_fills=1)
            self._indexed_put(key, len(sealed))

    def _indexed_put(self, key: str, size: int) -> None:
        """The in-process LRU (near stores that do not cap themselves): evict least recently used past the cap."""
        if self._index is None:
            return
        victims = []
        with self._lock:
            self._indexed += size - self._index.pop(key, 0)
            self._index[key] = size
            while self._indexed > self.near_bytes and len(self._index) > 1:
                victim, vsize = self._index.popitem(last=False)
                self._indexed -= vsize
                victims.append(victim)
            self._counts["near_evictions"] += len(victims)
        for victim in victims:
            self._near_delete(victim)

    def _touch(self, keys: Iterator[str] | list[str]) -> None:
        if self._index is None:
            return
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)

    def _damaged(self, key: str) -> None:
        self._add(near_damaged=1)
        self._drop_near(key)

    def _drop_near(self, key: str) -> None:
        if self._index is not None:
            with self._lock:
                self._indexed -= self._index.pop(key, 0)
        self._near_delete(key)

    def _near_delete(self, key: str) -> None:
        try:
            self.near.delete(key)
        except StoreError as exc:
            self._warn("near tier delete of %s failed: %s", key, exc)

    def _add(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def _warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _LOG_INTERVAL_S:
            self._last_warning = now
            logger.warning("kvcodec near tier: " + message, *args)

    def _close(self) -> None:
        drained = self.flush(self.flush_s)
        with self._lock:
            left = self._queued
        self._writers.shutdown(wait=drained, cancel_futures=True)
        if not drained:
            logger.warning("kvcodec near tier: closing with %d far write(s) not done after %.1f s (flush_s); "
                           "they are lost", left, self.flush_s)
        self.near.close()
        self.inner.close()


_OPTIONS = ("near", "near_bytes", "far_queue_bytes", "far_threads", "flush_s")


def far_url(url: str) -> str:
    """The far store's URL inside a ``cache+`` URL (this tier's options taken out)."""
    base, options = split_query(url[len("cache+") :])
    return with_query(base, {k: v for k, v in options.items() if k not in _OPTIONS})


def from_url(url: str, open_inner: Callable[[str], Store]) -> NearTier:
    """``cache+<far url>?near=<file:// or memory:// url>&near_bytes=SIZE[&far_queue_bytes=SIZE&far_threads=N&flush_s=S]``."""
    settings = _settings(url)
    near = open_inner(settings.near)
    evictions = _evictions(near) if settings.self_capped else None
    try:
        far = open_inner(settings.far)
    except BaseException:
        near.close()
        raise
    return NearTier(far, near, settings.near_bytes, self_capped=settings.self_capped,
                    far_queue_bytes=settings.far_queue_bytes, far_threads=settings.far_threads,
                    flush_s=settings.flush_s, evictions=evictions)


def check_url(url: str, check_inner: Callable[[str], object]) -> None:
    """Refuse what :func:`from_url` would refuse, both tiers' URLs included, without opening anything."""
    settings = _settings(url)
    check_inner(settings.near)
    check_inner(settings.far)


@dataclasses.dataclass(frozen=True)
class _Settings:
    far: str
    near: str  # a file near tier's URL carries the cap: it keeps itself under near_bytes by its own LRU
    self_capped: bool
    near_bytes: int
    far_queue_bytes: int
    far_threads: int
    flush_s: float


def _settings(url: str) -> _Settings:
    base, options = split_query(url[len("cache+") :])
    if "near" not in options or "near_bytes" not in options:
        raise StoreURLError(f"{redact_url(url)} needs near=<file:// or memory:// URL> and near_bytes=<size, e.g. 32GiB>")
    near_url = unquote(options.pop("near"))
    near_bytes = parse_size("near_bytes", options.pop("near_bytes"))
    far_queue = parse_size("far_queue_bytes", options.pop("far_queue_bytes", str(DEFAULT_FAR_QUEUE_BYTES)))
    far_threads = parse_int("far_threads", options.pop("far_threads", "2"), minimum=1)
    flush_s = parse_float("flush_s", options.pop("flush_s", "30"))
    scheme = near_url.split(":", 1)[0].lower()
    if scheme not in NEAR_SCHEMES:
        raise StoreURLError(f"near={redact_url(near_url)!r}: a near tier is a file:// or memory:// store on this host")
    if scheme == "file":
        near_base, near_options = split_query(near_url)
        reject_unknown(near_options, {"fsync"}, near_url)  # the cap is near_bytes, given once
        near_url = with_query(near_base, {**near_options, "max_bytes": str(near_bytes)})
    return _Settings(with_query(base, options), near_url, scheme == "file", near_bytes, far_queue, far_threads, flush_s)


def _evictions(near: Store) -> Callable[[], int]:
    """How many objects a file near tier's own LRU has evicted so far."""
    cap = getattr(getattr(near, "inner", near), "_cap", None)
    return (lambda: cap.evicted) if cap is not None else (lambda: 0)


__all__ = ["BytesRange", "CheckedRange", "NearTier", "far_url", "from_url", "seal", "unseal"]
