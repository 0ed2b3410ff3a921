"""KV cache events for routers: the blocks this instance put into the store, or found it cannot load from there.

A cache-aware router (llm-d's KV indexer, Dynamo's KV router) keeps an index
of which prefixes each instance can serve, fed by vLLM's KV cache events
(``--kv-events-config``): ``BlockStored`` / ``BlockRemoved`` with *vLLM's own
block hashes* (``request.block_hashes``: a chain over the prompt's tokens, the
same on every instance), which the router computes for an incoming prompt and
matches against its index. vLLM publishes its GPU prefix cache that way; this
module adds the store's tier, so a prefix that left the GPU but sits in the
store still counts for routing.

Events are made in the scheduler process, where vLLM's publisher collects
them (``KVConnectorBase_V1.take_events`` after ``update_connector_output``):

- **stored**: when a save is planned, its payload is snapshotted while the
  request is alive (its block hashes, parent hash and token ids: the request
  may end before the put lands), and one ``BlockStored`` per vLLM KV cache
  group is emitted once the worker reports that the save landed (on every
  tensor-parallel rank: the chunk is loadable only with all of them). A save
  that did not land is never announced.
- **removed**: a load that failed (object missing, damaged, or late) makes
  the scheduler half stop offering the chunk (:mod:`~.load_ledger`), so it is
  announced as ``BlockRemoved``; a later save of the chunk announces it again.
  The connector deletes nothing itself, and evictions by the store (Redis
  ``maxmemory``, Mooncake's eviction, a capped file store) are not seen.

Hashes are of the stored object's whole blocks per group, at that group's
block size (vLLM's ``resolve_block_hashes``), so they equal the GPU events'
hashes of the same tokens. ``medium`` is ``kv_events_medium`` (default
``KVCODEC``); ``ownership`` is ``kv_events_ownership`` (default ``kvcodec``):
vLLM's field for the secondary tier that generated an event, which is what
makes vllm-router count these blocks as its External tier rather than as
GPU blocks (it reads the tier from ``medium`` only for events without one, and
takes an unknown medium for ``GPU``); ``locality`` is ``LOCAL`` for a store
whose reads are memory copies on this host (a local file store, memory) and
``REMOTE`` otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from vllm_kvcodec.plans.outcomes import LoadOutcome, SaveOutcome
from vllm_kvcodec.stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from vllm_kvcodec.connector.config import ConnectorConfig
    from vllm_kvcodec.connector.lookup import Tail
    from vllm_kvcodec.plans.loads import ChunkLoad

logger = logging.getLogger("vllm_kvcodec")
#: Snapshots kept for saves and loads whose outcome has not come (bounded: a lost report must not leak them).
MAX_PENDING = 4096


@dataclasses.dataclass(frozen=True)
class _GroupBlocks:
    """One stored object's whole blocks in one KV cache group: what a BlockStored / BlockRemoved names."""

    group: int
    block_size: int
    hashes: list[Any]  # vLLM's external block hashes (bytes, or 64-bit ints with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent: Any
    token_ids: list[int]
    extra_keys: list[tuple[Any, ...] | None] | None


@dataclasses.dataclass
class _PendingSave:
    blocks: list[_GroupBlocks]
    lora_id: int | None
    lora_name: str | None
    session_id: str | None
    landed: int = 0  # ranks that reported it landed


class StoreEvents:
    """The connector's KV events, collected between two ``take`` calls of vLLM's scheduler (off: nothing is kept)."""

    def __init__(self, *, enabled: bool, medium: str = "KVCODEC", locality: str | None = None,
                 ownership: str | None = "kvcodec", block_sizes: Sequence[int] = (), hash_block_size: int = 0,
                 savers: int = 1, stats: ConnectorStats | None = None) -> None:
        self.enabled = enabled
        self.medium, self.locality, self.ownership = medium, locality, ownership
        self.block_sizes, self.hash_block_size = list(block_sizes), hash_block_size
        self.savers = savers  # workers that report each chunk's save (TP ranks that write x pipeline stages)
        self.stats = stats if stats is not None else ConnectorStats()
        self._saves: dict[str, _PendingSave] = {}  # chunk hash -> its save in flight
        self._loads: dict[int, dict[str, list[_GroupBlocks]]] = {}  # load id -> chunk hash -> its blocks
        self._events: list[KVCacheEvent] = []

    @classmethod
    def off(cls) -> "StoreEvents":
        return cls(enabled=False)

    # ---- saves ----------------------------------------------------------------------
    def saving(self, request: "Request", chunk_hash: str, first: int, tokens: int) -> None:
        """A save of ``request``'s tokens ``[first, first + tokens)`` was planned: snapshot what its event will say."""
        if not self.enabled:
            return
        blocks = self._blocks(request, first, tokens, with_tokens=True)
        if not blocks:
            return
        lora = request.lora_request
        _bounded_put(self._saves, chunk_hash, _PendingSave(
            blocks, lora.adapter_id if lora else None, lora.name if lora else None, getattr(request, "session_id", None)))

    def save_settled(self, outcome: SaveOutcome) -> None:
        """One worker's outcome of a save: BlockStored once every saving worker's landed; a save that failed is forgotten."""
        pending = self._saves.get(outcome.chunk_hash) if self.enabled else None
        if pending is None:
            return
        if not outcome.landed:
            del self._saves[outcome.chunk_hash]  # planned again, and snapshotted again, if it still can be
            return
        pending.landed += 1
        if pending.landed < self.savers:
            return
        del self._saves[outcome.chunk_hash]
        for b in pending.blocks:
            self._events.append(BlockStored(
                block_hashes=list(b.hashes), parent_block_hash=b.parent, token_ids=b.token_ids,
                block_size=b.block_size, lora_id=pending.lora_id, medium=self.medium, lora_name=pending.lora_name,
                extra_keys=b.extra_keys, group_idx=b.group, locality=self.locality, ownership=self.ownership,
                session_id=pending.session_id))
        self.stats.add(kv_events_stored_blocks=sum(len(b.hashes) for b in pending.blocks))

    # ---- loads ----------------------------------------------------------------------
    def loading(self, load_id: int, request: "Request", chunks: Iterable["ChunkLoad"], chunk_hashes: Sequence[str],
                tail: "Tail | None", chunk_size: int) -> None:
        """A load was planned: remember each object's blocks, which a BlockRemoved names if the load fails.

        A full chunk is found by its key in the request's chain
        (``chunk_hashes``); the blocks after the hit chunks (``tail``) are
        the first ``tail.tokens`` of chunk ``tail.index``, whatever object
        holds them.
        """
        if not self.enabled:
            return
        objects, positions = {}, {h: i for i, h in enumerate(chunk_hashes)}
        for c in chunks:
            if tail is not None and c.chunk_hash == tail.chunk_hash:
                objects[c.chunk_hash] = self._blocks(request, tail.index * chunk_size, tail.tokens, with_tokens=False)
            elif (index := positions.get(c.chunk_hash)) is not None:
                objects[c.chunk_hash] = self._blocks(request, index * chunk_size, chunk_size, with_tokens=False)
        _bounded_put(self._loads, load_id, objects)  # by load: a request id may come back (load_ledger.py)

    def load_settled(self, outcome: LoadOutcome) -> None:
        """A load's outcome: BlockRemoved for each object that failed (this instance stops offering it)."""
        objects = self._loads.pop(outcome.load_id, None) if self.enabled else None
        if objects is None:
            return
        for chunk_hash in outcome.failed:
            for b in objects.get(chunk_hash, ()):
                self._events.append(BlockRemoved(block_hashes=list(b.hashes), medium=self.medium, group_idx=b.group,
                                                 locality=self.locality, ownership=self.ownership))
                self.stats.add(kv_events_removed_blocks=len(b.hashes))

    # ---- out ------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (vLLM's scheduler publishes them with its own, once per step)."""
        events, self._events = self._events, []
        return events

    def _blocks(self, request: "Request", first: int, tokens: int, with_tokens: bool) -> list[_GroupBlocks]:
        """Per KV cache group, the whole blocks of tokens ``[first, first + tokens)`` in vLLM's block hashes.

        Empty for a group of which no whole block is in the span, or whose
        hashes vLLM has not computed (a request without prefix hashing).
        """
        out = []
        for group, block_size in enumerate(self.block_sizes):
            lo, hi = -(-first // block_size), (first + tokens) // block_size
            view = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
            if lo >= hi or hi > len(view):
                continue
            hashes = [maybe_convert_block_hash(view[i]) for i in range(lo, hi)]
            parent = maybe_convert_block_hash(view[lo - 1]) if lo else None
            token_ids = list(request.all_token_ids[lo * block_size : hi * block_size]) if with_tokens else []
            extra = _extra_keys(request, lo, hi, block_size) if with_tokens else None
            out.append(_GroupBlocks(group, block_size, hashes, parent, token_ids, extra))
        return out


def _extra_keys(request: "Request", lo: int, hi: int, block_size: int) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block extra hash keys (LoRA name, cache salt, ...), as its own BlockStored events carry them."""
    keys, mm_index = [], 0
    for b in range(lo, hi):
        key, mm_index = generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, mm_index)
        keys.append(key)
    return to_event_extra_keys(keys) if any(k is not None for k in keys) else None


def _bounded_put(table: dict[str, Any], key: str, value: Any) -> None:
    """Insert, dropping the oldest entries beyond MAX_PENDING (their outcome never came; at worst an event is lost)."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_PENDING:
        del table[next(iter(table))]


def store_events_for(vllm_config: "VllmConfig", config: "ConnectorConfig", kv_cache_config: "KVCacheConfig | None",
                     block_sizes: Sequence[int], savers: int, stats: ConnectorStats) -> StoreEvents:
    """On when vLLM publishes KV cache events (``--kv-events-config``) and ``kv_events`` is not turned off."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if not (config.kv_events and events_config is not None and events_config.enable_kv_cache_events):
        return StoreEvents.off()
    from storage import reads_in_memory

    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
    locality = "LOCAL" if reads_in_memory(config.store) else "REMOTE"
    logger.info("kvcodec: publishing the store's KV cache events as medium %r, ownership %r (%s)",
                config.kv_events_medium, config.kv_events_ownership, locality)
    return StoreEvents(enabled=True, medium=config.kv_events_medium, locality=locality,
                       ownership=config.kv_events_ownership, block_sizes=block_sizes,
                       hash_block_size=hash_block_size, savers=savers, stats=stats)
