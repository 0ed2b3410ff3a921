"""An LMCache MP L2 adapter over this project's stores (``file://``, ``redis://``, ``redis+cluster://``, ``mooncake://``, ...).

Configured as LMCache's ``plugin`` adapter type::

    {"type": "plugin", "module_path": "vllm_kvcodec.lmcache_mp", "class_name": "KVCodecL2Adapter",
     "adapter_params": {"store": "redis://host:6379/0"}, "serde": {"type": "kvcodec-rans"}}

Each object is stored under :func:`~.object_keys.object_name` as a small record:
``b"KVL2" | u16 version | u16 flags | u64 length | u64 XXH3-64(name) | content | u64 XXH3-64(all before)``.
So even without a serde a corrupted, truncated or swapped value is a miss, never
wrong bytes. The content is LMCache's buffer as handed over; on a load it must
fill the destination exactly, except a kvcodec serde frame (self-delimiting,
checked again by the serde), which may be shorter: that is how an exact-size
serde's objects take only their compressed bytes here.

Store calls run on the adapter's own threads; LMCache's controllers only see
task ids and event fds. Lookups do not lock (our stores do not evict under LMCache).
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from storage.errors import StoreError
from storage.registry import check_url, open_store
from vllm_kvcodec.errors import ChunkFormatError, ConfigError
from vllm_kvcodec.lmcache_mp import frame
from vllm_kvcodec.lmcache_mp.object_keys import object_name

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger(__name__)

RECORD_MAGIC = b"KVL2"
RECORD_VERSION = 1
_HEAD = struct.Struct("<4sHHQQ")
_SUM = struct.Struct("<Q")


class KVCodecL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the plug-in: ``store`` (URL, required), ``threads`` (default 4), ``max_capacity_bytes`` (0)."""

    def __init__(self, store: str, threads: int = 4, max_capacity_bytes: int = 0) -> None:
        self.store = store
        self.threads = threads
        self.max_capacity_bytes = max_capacity_bytes

    @classmethod
    def from_dict(cls, d: dict) -> KVCodecL2AdapterConfig:
        unknown = set(d) - {"store", "threads", "max_capacity_bytes"}
        if unknown:
            raise ConfigError(f"kvcodec L2 adapter: unknown adapter_params {sorted(unknown)}")
        store = d.get("store")
        if not isinstance(store, str) or not store:
            raise ConfigError("kvcodec L2 adapter: adapter_params.store must be a store URL (redis://, file://, ...)")
        check_url(store)
        threads = d.get("threads", 4)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ConfigError(f"kvcodec L2 adapter: threads must be an integer in [1, 64], got {threads!r}")
        capacity = d.get("max_capacity_bytes", 0)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"kvcodec L2 adapter: max_capacity_bytes must be an integer >= 0, got {capacity!r}")
        return cls(store, threads, capacity)

    @classmethod
    def help(cls) -> str:
        return ("kvcodec L2 adapter (adapter_params): store (str, a vllm-kvcodec store URL, required), "
                "threads (int, default 4), max_capacity_bytes (int, default 0: no global eviction)")


def pack_record(name: str, content: memoryview) -> list[bytes | memoryview]:
    """The stored record around ``content`` as parts (the caller joins them once)."""
    head = _HEAD.pack(RECORD_MAGIC, RECORD_VERSION, 0, len(content), xxhash.xxh3_64_intdigest(name.encode()))
    digest = xxhash.xxh3_64(head)
    digest.update(content)
    return [head, content, _SUM.pack(digest.intdigest())]


def unpack_record(name: str, value: bytes | memoryview) -> memoryview:
    """The content of a record read under ``name``, after its magic, length, name binding and checksum are checked."""
    view = memoryview(value).cast("B")
    if len(view) < _HEAD.size + _SUM.size:
        raise ChunkFormatError(f"{name}: {len(view)} bytes are too short for a kvcodec L2 record")
    magic, version, flags, length, bound = _HEAD.unpack_from(view)
    if magic != RECORD_MAGIC or version != RECORD_VERSION or flags != 0:
        raise ChunkFormatError(f"{name}: not a kvcodec L2 record (magic {bytes(magic)!r}, version {version})")
    if _HEAD.size + length + _SUM.size != len(view):
        raise ChunkFormatError(f"{name}: record says {length} bytes of content, value holds {len(view) - _HEAD.size - _SUM.size}")
    if bound != xxhash.xxh3_64_intdigest(name.encode()):
        raise ChunkFormatError(f"{name}: record was written under another key (a swapped or misplaced object)")
    (stored,) = _SUM.unpack_from(view, len(view) - _SUM.size)
    if xxhash.xxh3_64_intdigest(view[: len(view) - _SUM.size]) != stored:
        raise ChunkFormatError(f"{name}: record checksum mismatch: the object is corrupted")
    return view[_HEAD.size : _HEAD.size + length]


def fill(dst: memoryview, content: memoryview, name: str) -> None:
    """Copy ``content`` into the load buffer: exactly its size, or a shorter kvcodec serde frame."""
    if len(content) != len(dst) and not (len(content) < len(dst) and frame.is_frame(content)):
        raise ChunkFormatError(f"{name}: stored {len(content)} bytes, LMCache's buffer holds {len(dst)}")
    np.frombuffer(dst, dtype=np.uint8)[: len(content)] = np.frombuffer(content, dtype=np.uint8)


class KVCodecL2Adapter(L2AdapterInterface):
    """LMCache's non-blocking L2 interface (submit, event fd, query) over a blocking vllm-kvcodec store."""

    config_class_name = "KVCodecL2AdapterConfig"

    def __init__(self, config: KVCodecL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        self._store = open_store(config.store)
        self._pool = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="kvcodec-l2")
        self._store_efd, self._lookup_efd, self._load_efd = (create_event_notifier() for _ in range(3))
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stored: dict[L2TaskId, L2StoreResult] = {}
        self._looked_up: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        self._sizes: dict[str, int] = {}  # bytes per stored name, for LMCache's usage accounting on delete
        logger.info("kvcodec L2 adapter on %s (%d threads)", self._store.url, config.threads)

    # -- event fds -------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- tasks -----------------------------------------------------------
    def _submit(self, work: Callable[[], Any], results: dict, notifier: Any, failed: Callable[[], Any]) -> L2TaskId:
        task_id = next(self._ids)

        def run() -> None:
            try:
                result = work()
            except Exception:  # noqa: BLE001 - any failure is reported to LMCache as a failed task, never raised
                logger.exception("kvcodec L2 adapter task %d failed", task_id)
                result = failed()
            with self._lock:
                results[task_id] = result
            notifier.notify()

        self._pool.submit(run)
        return task_id

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(lambda: self._put(keys, objects), self._stored, self._store_efd,
                            lambda: L2StoreResult(False, 0))

    def _put(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        names = [object_name(k) for k in keys]
        records = [b"".join(pack_record(n, obj.byte_array)) for n, obj in zip(names, objects, strict=True)]
        self._store.put_many(zip(names, records, strict=True))
        sizes = [len(r) for r in records]
        with self._lock:
            fresh = [(k, n, s) for k, n, s in zip(keys, names, sizes, strict=True) if n not in self._sizes]
            self._sizes.update((n, s) for _, n, s in fresh)
        if fresh:
            self._notify_keys_stored([k for k, _, _ in fresh], [s for _, _, s in fresh])
        return L2StoreResult(True, sum(sizes))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
                                    ) -> L2TaskId:
        return self._submit(lambda: self._lookup(keys), self._looked_up, self._lookup_efd, lambda: Bitmap(len(keys)))

    def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        for i, present in enumerate(self._store.exists_many(object_name(k) for k in keys)):
            if present:
                bitmap.set(i)
        return bitmap

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None  # lookups take no locks

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(lambda: self._get(keys, objects), self._loaded, self._load_efd, lambda: Bitmap(len(keys)))

    def _get(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        names = [object_name(k) for k in keys]
        bitmap = Bitmap(len(keys))
        for i, (name, value) in enumerate(zip(names, self._store.get_many(names), strict=True)):
            if value is None:
                continue
            try:
                fill(objects[i].byte_array, unpack_record(name, value), name)
            except ChunkFormatError as exc:
                logger.warning("kvcodec L2 adapter: %s; treated as a miss", exc)
                continue
            bitmap.set(i)
        hits = [keys[i] for i in bitmap.get_indices_list()]
        if hits:
            self._notify_keys_accessed(hits)
        return bitmap

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # -- eviction, status, lifecycle ---------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        gone, sizes = [], []
        for key in keys:
            name = object_name(key)
            try:
                self._store.delete(name)
            except StoreError as exc:
                logger.warning("kvcodec L2 adapter: delete of %s failed: %s", name, exc)
                continue
            with self._lock:
                size = self._sizes.pop(name, None)
            if size is not None:
                gone.append(key)
                sizes.append(size)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        return {"is_healthy": not self._store.is_down, "store": self._store.url, "objects_stored": len(self._sizes)}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()
        for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
            notifier.close()
