"""``mooncake://`` — Mooncake Store: one pool made of many machines' memory, behind one master.

URL options are in :mod:`storage.mooncake_options`; what Mooncake does on its own
(eviction, leases, a master restart, a node leaving) and why the connector can
rely on it is in docs/which-store.md.

How each call maps onto the client (chosen by measuring the alternatives in
bench stores; none of the batched or zero-copy variants was more than noise
apart on loopback, so the choice is the one that moves each byte least):

- ``put_many``/``put``: values are copied once into registered memory from a
  :class:`mooncake.store.BufferPool`, each followed by its trailer
  (:mod:`storage.mooncake_frame`), and written with one ``batch_upsert_from``.
  Upsert, not put: Mooncake's put keeps the first value of a key and reports
  success for the second, which would break "overwrite replaces". Of two
  concurrent upserts of one key the later one wins and the earlier is refused
  (ILLEGAL_CLIENT): that put counts as done, overwritten at once. Objects a full
  pool has no room for (NO_AVAILABLE_HANDLE) are retried for ~2 s while the
  master evicts.
- ``get_many``/``get``: one ``batch_get_buffer`` of the distinct keys
  (``get_buffer`` for one): the client reads into its own registered buffer, the
  trailer is checked in place, then the value is copied out once. Mooncake answers a missing key and a failed read alike (no
  buffer), so the keys without one are asked about with ``batch_is_exist``:
  an error code there means the master is unreachable (StoreUnavailableError),
  and a key that exists but could not be read (a batch larger than the buffer,
  a node that just left) is read once more on its own, then counted a miss.
- ``exists_many``: one ``batch_is_exist``, which also grants a read lease.
- ``delete``: ``remove(force=True)``; see the frame module for why that is safe.
- ``keys``: the master's admin endpoint ``/get_all_keys`` (inspection only).

Every call runs under a :class:`storage.deadline.Deadline` (``timeout_s``), because
the client waits 30 s for a master that stopped answering; the hop to its worker
thread costs ~0.04 ms, against ~1 ms for a 1 MiB get on loopback.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any, TypeVar

from mooncake.store import BufferPool, MooncakeDistributedStore, ReplicateConfig

from storage.base import Store
from storage.deadline import Deadline
from storage.errors import StoreError, StoreUnavailableError
from storage.mooncake_frame import TRAILER_SIZE, trailer, unframe
from storage.mooncake_options import MooncakeOptions, parse_mooncake_url
from storage.options import redact_url

_T = TypeVar("_T")
logger = logging.getLogger("vllm_kvcodec")

# mooncake-store/include/types.h; the ones below mean "the pool cannot be reached", not "this call is wrong".
_CODES = {
    -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1000: "ETCD_OPERATION_ERROR",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
_UNREACHABLE = {-103, -800, -900, -901, -1000, -1010}
OBJECT_NOT_FOUND = -704
# An upsert that another client's later upsert of the same key overtook: the key holds that writer's value,
# as if this put had landed first. Not a failure.
SUPERSEDED = -601
NO_ROOM = -200  # NO_AVAILABLE_HANDLE: the pool is full until the master's eviction frees space
_FULL_POOL_PAUSES_S = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8)  # ~2 s: the master evicts every 10 ms, later on a busy host
_CONNECT_PROBE_S = 1.0
_UNREAD: Any = object()  # batch_get_buffer returned no buffer for this key


class MooncakeStore(Store):
    def __init__(self, url: str) -> None:
        super().__init__(redact_url(url))
        self.options: MooncakeOptions = parse_mooncake_url(url)
        self._deadline = Deadline(self.options.timeout_s, name="kvcodec-mooncake")
        self._config = ReplicateConfig()
        self._config.replica_num = self.options.replicas
        try:
            self._client = self._join()
            self._staging = BufferPool(self._client, max_bytes=self.options.buffer)
        except BaseException:
            self._deadline.close()
            raise

    @property
    def prefix(self) -> str:
        return self.options.prefix

    # -- the store protocol ------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        return self._get_many([key])[0]

    def _put(self, key: str, value: memoryview) -> None:
        self._put_many([(key, value)])

    def _exists(self, key: str) -> bool:
        return self._exists_many([key])[0]

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        # Unique keys only: batch_get_buffer given one key twice returns garbage for the first (0.3.13.post1).
        unique = list(dict.fromkeys(self.options.prefix + k for k in keys))
        values = dict(zip(unique, self._call(lambda: self._read(unique), f"get of {len(unique)} object(s)")))
        return [values[self.options.prefix + k] for k in keys]

    def _put_many(self, items: list[tuple[str, memoryview]]) -> None:
        last = list(dict(items).items())  # one write per key, the last value given (as if put one by one)
        for group in _groups(last, self.options.buffer):
            framed = [(self.options.prefix + k, v) for k, v in group]
            self._call(lambda framed=framed: self._write(framed), f"put of {len(group)} object(s)")

    def _exists_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        full = [self.options.prefix + k for k in keys]
        codes = self._call(lambda: self._client.batch_is_exist(full), f"exists of {len(keys)} key(s)")
        self._raise_for(codes, "exists")
        return [code == 1 for code in codes]

    def _delete(self, key: str) -> None:
        code = self._call(lambda: self._client.remove(self.options.prefix + key, True), "delete")
        if code not in (0, OBJECT_NOT_FOUND):
            self._raise_for([code], "delete")

    def _keys(self, prefix: str) -> Iterator[str]:
        wanted = self.options.prefix + prefix
        for line in self._call(self._all_keys, "listing keys").splitlines():
            if line.startswith(wanted):
                yield line[len(self.options.prefix) :]

    def _close(self) -> None:
        if not self._deadline.close(self._release):
            logger.warning(
                "kvcodec: a call on %s is still running in the Mooncake client; its client is left open", self.url
            )

    def _release(self) -> None:
        with suppress(Exception):
            self._staging.close()
        with suppress(Exception):
            self._client.close()

    # -- what runs on the deadline's workers ----------------------------------------------

    def _join(self) -> MooncakeDistributedStore:
        """Set up a client in the pool; a master that does not even accept a connection fails at once."""
        o = self.options
        try:
            socket.create_connection((o.master_host, o.master_port), timeout=min(_CONNECT_PROBE_S, o.timeout_s)).close()
        except OSError as exc:
            raise StoreUnavailableError(f"Mooncake master of {self.url} is unreachable: {exc}") from None
        setup = _Setup((o.local_host, o.metadata, o.segment, o.buffer, o.protocol, o.device, o.master))
        try:
            rc = self._call(setup.run, "joining the pool")
        except StoreUnavailableError:
            setup.abandon()
            raise
        if rc != 0:
            raise StoreUnavailableError(f"could not join the Mooncake pool of {self.url}: setup returned {rc}")
        return setup.client

    def _read(self, full: list[str]) -> list[bytes | None]:
        # One key: get_buffer, 0.3 ms quicker per call than a batch of one. The batch's handles die
        # with the comprehension, freeing the client buffer for the retries below.
        handles = [self._client.get_buffer(full[0])] if len(full) == 1 else self._client.batch_get_buffer(full)
        values = [_UNREAD if h is None else _value(k, h) for k, h in zip(full, handles)]
        del handles
        unread = [i for i, v in enumerate(values) if v is _UNREAD]
        if unread:
            codes = self._client.batch_is_exist([full[i] for i in unread])
            self._raise_for(codes, "get")
            for i, code in zip(unread, codes):
                values[i] = self._read_alone(full[i]) if code == 1 else None
        return values

    def _read_alone(self, key: str) -> bytes | None:
        """A key that exists but was not read in its batch: alone it may fit the buffer; else say why, or miss."""
        handle = self._client.get_buffer(key)
        if handle is not None:
            return _value(key, handle)
        size = self._client.get_size(key)
        if size > self.options.buffer:
            raise StoreError(
                f"object {key!r} in {self.url} is {size} bytes, more than buffer={self.options.buffer}; raise buffer"
            )
        return None  # evicted since, or its node left: a miss

    def _write(self, items: list[tuple[str, memoryview]]) -> None:
        sizes = [v.nbytes + TRAILER_SIZE for _, v in items]
        if sum(sizes) > self.options.buffer:  # only a single object can be: _groups splits batches
            raise StoreError(f"an object of {sizes[0]} bytes does not fit buffer={self.options.buffer} of {self.url}")
        lease = self._staging.acquire(sum(sizes), timeout=self.options.timeout_s)
        try:
            codes = self._upsert([k for k, _ in items], _stage(lease, items, sizes), sizes)
        finally:
            lease.release()
        self._raise_for([0 if c == SUPERSEDED else c for c in codes], "put")

    def _upsert(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``batch_upsert_from``, retrying the objects a full pool had no room for while the master evicts.

        A full pool is a cache's steady state: the master evicts in the background
        (every 10 ms, ``eviction_ratio`` of the pool at a time), so a put that
        finds no room (NO_AVAILABLE_HANDLE) usually finds it a moment later.
        """
        codes = self._client.batch_upsert_from(keys, ptrs, sizes, self._config)
        for pause in _FULL_POOL_PAUSES_S:
            retry = [i for i, c in enumerate(codes) if c == NO_ROOM]
            if not retry:
                break
            time.sleep(pause)
            again = self._client.batch_upsert_from(
                [keys[i] for i in retry], [ptrs[i] for i in retry], [sizes[i] for i in retry], self._config
            )
            for i, code in zip(retry, again):
                codes[i] = code
        return codes

    def _all_keys(self) -> str:
        with urllib.request.urlopen(f"{self.options.admin}/get_all_keys", timeout=self.options.timeout_s) as reply:
            return reply.read().decode("ascii", "replace")

    # -- errors -------------------------------------------------------------------------

    def _call(self, fn: Callable[[], _T], what: str) -> _T:
        try:
            return self._deadline.call(fn, f"{what} on {self.url}")
        except StoreError:
            raise
        except (OSError, RuntimeError) as exc:  # the admin endpoint, or the client's own complaints
            raise StoreUnavailableError(f"{what} on {self.url} failed: {type(exc).__name__}: {exc}") from None

    def _raise_for(self, codes: list[int], what: str) -> None:
        """Raise for the first failure in ``codes`` (0/1 are answers; negative numbers are Mooncake errors)."""
        failed = [c for c in codes if c < 0]
        if not failed:
            return
        code = failed[0]
        message = f"{what} on {self.url} failed for {len(failed)} of {len(codes)}: {_CODES.get(code, 'error')} ({code})"
        raise (StoreUnavailableError if code in _UNREACHABLE else StoreError)(message)


class _Setup:
    """``setup`` of a new client, which may outlive its deadline: a client that joins after its caller left is closed."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.client = MooncakeDistributedStore()
        self._args = args
        self._lock = threading.Lock()
        self._rc: int | None = None
        self._abandoned = False

    def run(self) -> int:
        rc = self.client.setup(*self._args)
        with self._lock:
            self._rc = rc
            if self._abandoned:
                self._close_joined()
        return rc

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            self._close_joined()

    def _close_joined(self) -> None:
        if self._rc == 0:
            self._rc = None
            with suppress(Exception):
                self.client.close()


def _value(key: str, handle: Any) -> bytes | None:
    with memoryview(handle) as stored:
        value = unframe(key, stored)
        return None if value is None else value.tobytes()


def _stage(lease: Any, items: list[tuple[str, memoryview]], sizes: list[int]) -> list[int]:
    """Copy each value and its trailer into the registered lease; the pointers to hand the client."""
    ptrs, offset = [], 0
    with memoryview(lease.buffer) as buf:
        for (key, value), size in zip(items, sizes):
            buf[offset : offset + value.nbytes] = value
            buf[offset + value.nbytes : offset + size] = trailer(key, value)
            ptrs.append(lease.ptr + offset)
            offset += size
    return ptrs


def _groups(items: list[tuple[str, memoryview]], limit: int) -> Iterator[list[tuple[str, memoryview]]]:
    """``items`` in runs whose framed size fits ``limit`` (one object alone may not: the pool then refuses it)."""
    group: list[tuple[str, memoryview]] = []
    size = 0
    for item in items:
        need = item[1].nbytes + TRAILER_SIZE
        if group and size + need > limit:
            yield group
            group, size = [], 0
        group.append(item)
        size += need
    if group:
        yield group
