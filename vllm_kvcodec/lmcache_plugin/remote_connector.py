"""An LMCache ``RemoteConnector`` that stores each chunk losslessly compressed in one of our stores.

LMCache's ``RemoteBackend`` owns the connector and calls it from its asyncio
loop thread (``get``/``put``/``exists``/batched forms, ``list``, ``close``,
``ping``) or from its own threads (``exists_sync``, ``batched_contains``,
``remove_sync``). Encoding, decoding and the blocking store calls never run on
that loop: they run in this connector's thread pools (one for gets and puts,
one small one for lookups, so a lookup never queues behind encoding), and the
coroutines await them.

What a ``get`` returns is a ``MemoryObj`` from LMCache's own allocator (the
local CPU backend), with the shapes, dtypes and memory format that were put,
bit for bit; or ``None``. A stored object that fails any check (envelope or
chunk checksum, its binding to the key asked for, an unknown codec, a shape,
dtype or format this engine does not expect) is a miss with a warning, never
data.

Each chunk is bound to its store key and KV group (:func:`group_binding`), so a
value another key's slot returns (a swap, a misrouted reply, a copy) is refused.
LMCache hands a remote connector keys and KV, never token ids: what proves the
tokens is the chunk hash in LMCache's key, its own prefix hash of them (see
docs/lmcache.md, "What a load proves").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Callable, List, Optional

import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from storage import StoreError, open_store
from vllm_kvcodec.codecs import get_codec, policy
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ChunkFormatError, ConfigError, KVCodecError
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.lmcache_plugin import envelope
from vllm_kvcodec.lmcache_plugin.store_keys import (
    DESCRIPTOR,
    ROOT,
    KeyMapper,
    KeyNamespace,
    group_binding,
    parse_descriptor,
    parse_store_key,
)
from vllm_kvcodec.lmcache_plugin.settings import PluginConfigError, PluginSettings
from vllm_kvcodec.runtime.threads import one_torch_thread, started_pool

logger = init_logger(__name__)

PING_KEY = f"{ROOT}ping"
PING_FAILED = -2  # LMCache's PING_GENERIC_ERROR_CODE


class KVCodecPluginConfigError(IrrecoverableException, ValueError):
    """The plug-in cannot work with this configuration (LMCache logs it and builds no remote backend)."""


class LayoutMismatch(ValueError):
    """A chunk's shapes, dtypes or memory format are not what this engine's LMCache expects."""


@dataclasses.dataclass
class PluginStats:
    puts: int = 0
    put_raw_bytes: int = 0
    put_stored_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    unusable: int = 0  # corrupted or mismatched objects turned into misses
    store_errors: int = 0

    @property
    def ratio(self) -> float:
        return self.put_raw_bytes / self.put_stored_bytes if self.put_stored_bytes else 0.0


class KVCodecRemoteConnector(RemoteConnector):
    """LMCache remote connector: LMCache chunks -> vllm-kvcodec chunk format -> any vllm-kvcodec store."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Optional[LMCacheEngineConfig],
        metadata: Optional[LMCacheMetadata] = None,
        plugin_name: Optional[str] = None,
    ) -> None:
        if config is None:
            raise KVCodecPluginConfigError("the kvcodec LMCache plug-in needs LMCache's engine config")
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            raise KVCodecPluginConfigError("the kvcodec LMCache plug-in needs LMCache's engine metadata")
        super().__init__(config, metadata)
        self._lmc_metadata = metadata
        try:
            self.settings = PluginSettings.from_extra_config(config.extra_config, plugin_name)
        except PluginConfigError as exc:
            raise KVCodecPluginConfigError(str(exc)) from None
        serde = getattr(config, "remote_serde", None) or "naive"
        if serde != "naive":
            raise KVCodecPluginConfigError(
                f"remote_serde: {serde!r} hands the connector already-serialized bytes; the kvcodec plug-in "
                "compresses LMCache's KV tensors itself and needs remote_serde: naive"
            )
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.stats = PluginStats()
        self._stats_lock = threading.Lock()
        self._codec_lock = threading.Lock()
        self._codecs: dict[torch.dtype, Codec] = {}
        for dtype in dict.fromkeys(self.meta_dtypes):
            try:
                self._codec_for(dtype, at_init=True)
            except KVCodecError as exc:
                raise KVCodecPluginConfigError(str(exc)) from None
        self.keys = KeyMapper(self.settings.namespace)
        self._described: set[str] = set()
        try:
            self.store = open_store(self.settings.store)
        except ValueError as exc:  # StoreURLError and friends: a configuration mistake
            raise KVCodecPluginConfigError(f"remote_storage_plugin.{self.settings.plugin_name}.store: {exc}") from None
        self._pool = started_pool(self.settings.threads, "kvcodec-lmc", one_torch_thread)  # beside vLLM's OpenMP team
        self._lookup_pool = started_pool(2, "kvcodec-lmc-lookup")
        self._closed = False
        logger.info(
            "kvcodec LMCache connector: store %s, codecs %s, %d threads, chunk shapes %s %s, format %s",
            self.store.url,
            {str(dt).replace("torch.", ""): c.codec_id for dt, c in self._codecs.items()},
            self.settings.threads,
            [tuple(s) for s in self.meta_shapes],
            [str(d).replace("torch.", "") for d in self.meta_dtypes],
            self.meta_fmt.name,
        )

    def __repr__(self) -> str:
        return f"<KVCodecRemoteConnector {self.store.url}>"

    # -- codecs ----------------------------------------------------------------

    def _codec_for_layout(self, fmt: MemoryFormat, dtype: torch.dtype) -> Codec:
        """rans models channels along the token axis: LMCache's layer-wise [T, 2, hidden] has it first."""
        codec = self._codec_for(dtype)
        if codec.codec_id == "rans" and fmt == MemoryFormat.KV_T2D:
            return get_codec({"id": "rans", "token_axis": 0})
        return codec

    def _codec_for(self, dtype: torch.dtype, at_init: bool = False) -> Codec:
        codec = self._codecs.get(dtype)
        if codec is not None:
            return codec
        with self._codec_lock:
            codec = self._codecs.get(dtype)
            if codec is not None:
                return codec
            wire = DType.from_torch(dtype)  # UnsupportedDTypeError for uint8 and other non-float elements
            try:
                codec, fell_back = policy.codec_for(self.settings.codec, wire, unsupported="fallback")
            except ConfigError as exc:
                raise KVCodecPluginConfigError(f"remote_storage_plugin.{self.settings.plugin_name}.codec: {exc}") from None
            name = wire.name.lower()
            if fell_back:
                log = logger.warning if self.settings.codec_explicit else logger.info
                log("kvcodec: codec %r cannot hold %s bit-exactly; using %r for %s chunks",
                    get_codec(self.settings.codec).codec_id, name, codec.codec_id, name)
            elif at_init:
                logger.info("kvcodec: %s chunks use codec %r", name, codec.codec_id)
            self._codecs[dtype] = codec
            return codec

    # -- layout checks -----------------------------------------------------------

    def _check_layout(self, fmt: MemoryFormat, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> None:
        """Raise LayoutMismatch unless these are a (full or partial) chunk of this engine's KV."""
        # Read the geometry now, not at creation: the serving engine may register its
        # KV layer groups with LMCache's metadata after the connector was built.
        meta_shapes = self._lmc_metadata.get_shapes()
        meta_dtypes = self._lmc_metadata.get_dtypes()
        if len(shapes) != len(meta_shapes) or len(dtypes) != len(meta_dtypes):
            raise LayoutMismatch(f"{len(shapes)} KV groups, this engine has {len(meta_shapes)}")
        tokens = None
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            full = tuple(meta_shapes[i])  # [kv, layers, chunk_tokens, hidden]
            if dtype != meta_dtypes[i]:
                raise LayoutMismatch(f"group {i} is {dtype}, this engine stores {meta_dtypes[i]}")
            shape = tuple(int(d) for d in shape)
            if fmt == self.meta_fmt and fmt in (MemoryFormat.KV_2LTD, MemoryFormat.KV_MLA_FMT) and len(shape) == 4:
                n = shape[2]
                expect = (full[0], full[1], n, full[3])
            elif fmt == MemoryFormat.KV_T2D and len(shape) == 3:  # layer-wise: [tokens, kv, hidden]
                n = shape[0]
                expect = (n, full[0], full[3])
            elif fmt == MemoryFormat.KV_2TD and len(shape) == 3:  # layer-wise with blending: [kv, tokens, hidden]
                n = shape[1]
                expect = (full[0], n, full[3])
            else:
                raise LayoutMismatch(f"memory format {fmt.name} with shape {shape}; this engine uses {self.meta_fmt.name} {full}")
            if shape != expect or not 1 <= n <= full[2]:
                raise LayoutMismatch(f"group {i} has shape {shape}; this engine expects {expect} with 1..{full[2]} tokens")
            if tokens is not None and n != tokens:
                raise LayoutMismatch(f"groups disagree on the token count ({tokens} vs {n})")
            tokens = n

    # -- the blocking work (runs in the pools) -------------------------------------

    @staticmethod
    def _group_tensors(memory_obj: MemoryObj) -> list[torch.Tensor]:
        meta = memory_obj.metadata
        if meta.shapes is not None and len(meta.shapes) > 1:
            tensors = [memory_obj.get_tensor(i) for i in range(len(meta.shapes))]
        else:
            tensors = [memory_obj.tensor]  # follows meta.shape, which a partial chunk narrows
        if any(t is None for t in tensors):
            raise ValueError("the MemoryObj is no longer valid")
        return [t if t.device.type == "cpu" else t.cpu() for t in tensors]

    def _encode(self, memory_obj: MemoryObj, store_key: str) -> tuple[bytes, int]:
        """The value of one MemoryObj, bound to ``store_key``, and its raw size; ValueError if it is not our KV."""
        fmt = memory_obj.get_memory_format()
        tensors = self._group_tensors(memory_obj)
        self._check_layout(fmt, [t.shape for t in tensors], [t.dtype for t in tensors])
        blobs = [encode_chunk(t, codec=self._codec_for_layout(fmt, t.dtype), key=group_binding(store_key, i))
                 for i, t in enumerate(tensors)]
        return envelope.pack(fmt.name, blobs), sum(t.numel() * t.element_size() for t in tensors)

    def _descriptors(self, namespaces: Sequence[KeyNamespace]) -> list[tuple[str, bytes]]:
        out: dict[str, bytes] = {}
        for ns in namespaces:
            if ns.digest not in self._described:
                out[ns.descriptor_key] = ns.descriptor()
        return list(out.items())

    def _put_values(self, items: list[tuple[str, bytes]], namespaces: Sequence[KeyNamespace]) -> None:
        self.store.put_many(self._descriptors(namespaces) + items)
        for ns in namespaces:
            self._described.add(ns.digest)

    def _put_one(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        ns, part = self.keys.split(key)
        store_key = ns.store_key(part)
        try:
            value, raw = self._encode(memory_obj, store_key)
        except Exception:
            self._count(put_failures=1)
            raise
        try:
            self._put_values([(store_key, value)], [ns])
        except StoreError:
            self._count(put_failures=1, store_errors=1)
            raise
        self._count(puts=1, put_raw_bytes=raw, put_stored_bytes=len(value))

    def _encode_or_skip(self, key: CacheEngineKey, store_key: str,
                        memory_obj: MemoryObj) -> Optional[tuple[bytes, int]]:
        try:
            return self._encode(memory_obj, store_key)
        except Exception as exc:
            self._count(put_failures=1)
            logger.warning("kvcodec: not storing %s: %s", key.to_string(), exc)
            return None

    def _get_values(self, store_keys: list[str]) -> list[Optional[bytes]]:
        try:
            return self.store.get_many(store_keys)
        except StoreError as exc:
            self._count(store_errors=1)
            logger.warning("kvcodec: store get of %d objects failed, treating them as misses: %s", len(store_keys), exc)
            return [None] * len(store_keys)

    def _decode(self, value: bytes, key: CacheEngineKey, store_key: str) -> Optional[MemoryObj]:
        """A MemoryObj of LMCache's allocator holding ``value``'s KV, or None (logged) if unusable."""
        try:
            fmt_name, blobs = envelope.unpack(value)
            try:
                fmt = MemoryFormat[fmt_name]
            except KeyError:
                raise ChunkFormatError(f"unknown LMCache memory format {fmt_name!r}") from None
            tensors = [decode_chunk(b, key=group_binding(store_key, i)) for i, b in enumerate(blobs)]
            shapes = [t.shape for t in tensors]
            dtypes = [t.dtype for t in tensors]
            self._check_layout(fmt, shapes, dtypes)
        except (ChunkFormatError, LayoutMismatch) as exc:
            self._count(unusable=1, misses=1)
            logger.warning("kvcodec: stored object %s (%s) is unusable, treating it as a miss: %s",
                           store_key, key.to_string(), exc)
            return None
        except Exception as exc:  # a decoder bug must not turn into data either
            self._count(unusable=1, misses=1)
            logger.warning("kvcodec: decoding %s (%s) failed, treating it as a miss: %r", store_key, key.to_string(), exc)
            return None
        memory_obj = self.local_cpu_backend.allocate(list(shapes), list(dtypes), fmt)
        if memory_obj is None:
            self._count(misses=1)
            logger.warning("kvcodec: LMCache could not allocate %s for %s; treating it as a miss", shapes, key.to_string())
            return None
        try:
            if len(tensors) == 1:
                memory_obj.tensor.copy_(tensors[0])
            else:
                for i, t in enumerate(tensors):
                    memory_obj.get_tensor(i).copy_(t)
        except BaseException:
            memory_obj.ref_count_down()
            raise
        self._count(hits=1)
        return memory_obj

    def _get_one(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        store_key = self.keys.store_key(key)
        self._count(gets=1)
        try:
            value = self.store.get(store_key)
        except StoreError as exc:
            self._count(store_errors=1, misses=1)
            logger.warning("kvcodec: store get of %s failed, treating it as a miss: %s", key.to_string(), exc)
            return None
        if value is None:
            self._count(misses=1)
            return None
        return self._decode(value, key, store_key)

    def _decode_counted(self, value: Optional[bytes], key: CacheEngineKey, store_key: str) -> Optional[MemoryObj]:
        self._count(gets=1)
        if value is None:
            self._count(misses=1)
            return None
        return self._decode(value, key, store_key)

    def _exists_many(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        try:
            return self.store.exists_many([self.keys.store_key(k) for k in keys])
        except StoreError as exc:
            self._count(store_errors=1)
            logger.warning("kvcodec: store lookup failed, treating %d keys as misses: %s", len(keys), exc)
            return [False] * len(keys)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # -- running blocking work from LMCache's loop ---------------------------------

    async def _run(self, pool: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any,
                   release_on_cancel: bool = False) -> Any:
        cf = pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            if release_on_cancel:  # LMCache gave up waiting (timeout): free what the thread still allocates
                cf.add_done_callback(_release_result)
            raise

    # -- RemoteConnector API ---------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self._run(self._lookup_pool, self._exists_many, [key]))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._exists_many([key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return _prefix_hits(self._exists_many(keys))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return _prefix_hits(await self._run(self._lookup_pool, self._exists_many, list(keys)))

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return await self._run(self._pool, self._get_one, key, release_on_cancel=True)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        keys = list(keys)
        store_keys = [self.keys.store_key(k) for k in keys]
        values = await self._run(self._pool, self._get_values, store_keys)
        return await self._decode_all(values, keys, store_keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The objects of the longest prefix of ``keys`` that is stored and usable."""
        keys = list(keys)
        store_keys = [self.keys.store_key(k) for k in keys]
        values = await self._run(self._pool, self._get_values, store_keys)
        n = _prefix_hits([v is not None for v in values])
        if n < len(keys):
            self._count(gets=1, misses=1)
        objs = await self._decode_all(values[:n], keys[:n], store_keys[:n])
        out: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            out.append(obj)
        for obj in objs[len(out):]:
            if obj is not None:
                obj.ref_count_down()
        return out

    async def _decode_all(self, values: Sequence[Optional[bytes]], keys: Sequence[CacheEngineKey],
                          store_keys: Sequence[str]) -> list[Optional[MemoryObj]]:
        results = await asyncio.gather(
            *(self._run(self._pool, self._decode_counted, v, k, sk, release_on_cancel=True)
              for v, k, sk in zip(values, keys, store_keys)),
            return_exceptions=True,
        )
        out: list[Optional[MemoryObj]] = []
        for key, result in zip(keys, results):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                logger.warning("kvcodec: get of %s failed, treating it as a miss: %r", key.to_string(), result)
                out.append(None)
            else:
                out.append(result)
        return out

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # LMCache's InstrumentedRemoteConnector drops the caller's reference once this returns.
        await self._run(self._pool, self._put_one, key, memory_obj)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        keys = list(keys)
        splits = [self.keys.split(k) for k in keys]
        store_keys = [ns.store_key(part) for ns, part in splits]
        encoded = await asyncio.gather(
            *(self._run(self._pool, self._encode_or_skip, k, sk, m)
              for k, sk, m in zip(keys, store_keys, memory_objs))
        )
        items: list[tuple[str, bytes]] = []
        namespaces: list[KeyNamespace] = []
        raw = 0
        for (ns, _), store_key, enc in zip(splits, store_keys, encoded):
            if enc is None:
                continue
            items.append((store_key, enc[0]))
            namespaces.append(ns)
            raw += enc[1]
        if not items:
            return
        try:
            await self._run(self._pool, self._put_values, items, namespaces)
        except StoreError:
            self._count(put_failures=len(items), store_errors=1)
            raise
        self._count(puts=len(items), put_raw_bytes=raw, put_stored_bytes=sum(len(v) for _, v in items))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            self.store.delete(self.keys.store_key(key))
            return True
        except StoreError as exc:
            logger.warning("kvcodec: removing %s failed: %s", key.to_string(), exc)
            return False

    async def list(self) -> List[str]:
        """LMCache key strings of every chunk under this plug-in's root (all namespaces)."""
        return await self._run(self._lookup_pool, self._list)

    def _list(self) -> list[str]:
        by_ns: dict[str, list[str]] = {}
        for store_key in self.store.keys(ROOT):
            parsed = parse_store_key(store_key)
            if parsed is None:
                continue
            digest, last = parsed
            chunks = by_ns.setdefault(digest, [])
            if last != DESCRIPTOR:
                chunks.append(last)
        digests = [d for d, chunks in by_ns.items() if chunks]
        described = self.store.get_many([f"{ROOT}{d}/{DESCRIPTOR}" for d in digests])
        out: list[str] = []
        for digest, raw in zip(digests, described):
            halves = parse_descriptor(raw) if raw is not None else None
            if halves is None:
                logger.debug("kvcodec: namespace %s has no descriptor; its chunks are not listed", digest)
                continue
            ns = KeyNamespace(halves[0], halves[1], digest)
            out.extend(ns.key_string(part) for part in by_ns[digest] if not part.startswith("h"))
        return out

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._run(self._lookup_pool, self.store.exists, PING_KEY)
            return 0
        except StoreError as exc:
            logger.warning("kvcodec: store ping failed: %s", exc)
            return PING_FAILED

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._close_sync)

    def _close_sync(self) -> None:
        self._pool.shutdown(wait=True)
        self._lookup_pool.shutdown(wait=True)
        self.store.close()
        s = self.stats
        logger.info(
            "kvcodec LMCache connector closed: %d puts (%.1f MB -> %.1f MB, ratio %.3f, %d failed), "
            "%d gets (%d hits, %d misses, %d unusable), %d store errors",
            s.puts, s.put_raw_bytes / 1e6, s.put_stored_bytes / 1e6, s.ratio, s.put_failures,
            s.gets, s.hits, s.misses, s.unusable, s.store_errors,
        )


def _prefix_hits(found: Sequence[bool]) -> int:
    for i, hit in enumerate(found):
        if not hit:
            return i
    return len(found)


def _release_result(cf: concurrent.futures.Future) -> None:
    if cf.cancelled() or cf.exception() is not None:
        return
    result = cf.result()
    for obj in result if isinstance(result, list) else [result]:
        if obj is not None:
            obj.ref_count_down()
