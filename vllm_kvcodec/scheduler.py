"""Scheduler half: lookup of stored prefixes and load/save planning.

Runs in vLLM's scheduler process; never touches KV memory. It finds the
longest stored prefix in whole chunks (one batched existence check per new
request, cached), tells vLLM how many tokens beyond its local prefix cache it
can load, and turns block allocations into slot mappings for the worker half:
loads of stored chunks, and saves of chunks that become complete in a step,
including chunks completed across several steps of a chunked prefill.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from storage import StoreError
from storage.outage import StoreDownError
from vllm_kvcodec.config import ConnectorConfig
from vllm_kvcodec.identity import PLAIN, prompt_identity
from vllm_kvcodec.keys import Namespace, chunk_hashes, object_key
from vllm_kvcodec.metadata import ChunkLoad, KVCodecMetadata, LoadSpec, SaveSpec
from vllm_kvcodec.stats import ConnectorStats
from vllm_kvcodec.store_access import open_connector_store

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvcodec")
RECENT_SAVES = 1 << 16  # chunk hashes remembered for de-duplicating saves (about 2 MB)
# How long a handed-out save suppresses saving the same chunk again. It only has to cover the
# time a save takes to land (later lookups then hit and plan no save); a save that never landed
# (dropped in an outage, evicted) must not keep its chunk out of the store for longer.
RECENT_SAVE_S = 60.0


@dataclasses.dataclass
class _Tracked:
    """What the scheduler half remembers about one request."""

    token_ids: list[int]
    hashes: list[str]  # keys of the prompt's full chunks (all of them, saved or not)
    hit_chunks: int  # chunks found in the store at lookup
    local_tokens: int = 0  # tokens vLLM had in its own prefix cache at lookup
    block_ids: list[int] = dataclasses.field(default_factory=list)
    next_save: int = 0  # first chunk not yet handed to the worker for saving
    computed: int = 0  # tokens computed before the current step


class SchedulerHalf:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, groups: int, tp_size: int, block_size: int) -> None:
        self.config = config
        self.namespace = namespace
        self.groups = groups
        self.tp_size = tp_size
        self.block_size = block_size
        self.chunk = config.chunk_size
        self.store = open_connector_store(config)
        self.stats = ConnectorStats()
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadSpec] = []
        # Chunks recently handed to the worker for saving: a burst of requests sharing a new
        # prefix looks it up before the first save lands, and must not encode and put it again.
        self._recently_saved: collections.OrderedDict[str, float] = collections.OrderedDict()

    # ---- lookup ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._track(request)
        tracked.local_tokens = num_computed_tokens
        hit_tokens = tracked.hit_chunks * self.chunk
        n = max(0, hit_tokens - num_computed_tokens)
        return n, bool(n) and self.config.load_mode == "async"

    def _track(self, request: "Request") -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tokens = list(request.prompt_token_ids or [])
            identity = prompt_identity(request)
            # Only whole chunks, and never the whole prompt: the last token is always computed.
            full = max(0, (len(tokens) - 1) // self.chunk) if identity is not None else 0
            if identity is None:
                self.stats.add(uncacheable_requests=1)
            hashes = chunk_hashes(self.namespace, tokens, full, identity or PLAIN)
            hit = self._longest_stored_prefix(hashes) if self.config.load else 0
            tracked = _Tracked(tokens, hashes, hit, next_save=hit)
            self._requests[request.request_id] = tracked
            self.stats.add(lookups=1, lookup_chunks=len(hashes), hit_chunks=hit)
        return tracked

    def _longest_stored_prefix(self, hashes: list[str]) -> int:
        if not hashes:
            return 0
        keys = [self._keys(h) for h in hashes]
        try:
            found = self.store.exists_many([k for ks in keys for k in ks])
        except StoreDownError:  # known outage, already logged once: a miss at no cost
            self.stats.add(lookup_failures=1, lookups_store_down=1)
            return 0
        except StoreError as exc:
            self.stats.add(lookup_failures=1)
            logger.warning("kvcodec: store lookup failed, computing the prefix instead: %s", exc)
            return 0
        per = len(keys[0])
        for c in range(len(hashes)):
            if not all(found[c * per : (c + 1) * per]):
                return c
        return len(hashes)

    def _keys(self, chunk_hash: str) -> list[str]:
        return [object_key(self.namespace, chunk_hash, r, g) for r in range(self.tp_size) for g in range(self.groups)]

    # ---- planning -------------------------------------------------------------------
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        start = tracked.local_tokens
        chunks = self._chunk_loads(tracked, start, start + num_external_tokens)
        self._pending_loads.append(LoadSpec(request.request_id, chunks, is_async=self.config.load_mode == "async"))

    def _chunk_loads(self, tracked: _Tracked, start: int, end: int) -> list[ChunkLoad]:
        loads = []
        for c in range(start // self.chunk, -(-end // self.chunk)):
            a, b = max(start, c * self.chunk), min(end, (c + 1) * self.chunk)
            slots = self._slots(tracked.block_ids, a, b)
            blocks = sorted({tracked.block_ids[t // self.block_size] for t in range(a, b)})
            loads.append(ChunkLoad(tracked.hashes[c], a - c * self.chunk, slots, blocks))
        return loads

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[t // bs] * bs + t % bs for t in range(start, end)]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCodecMetadata:
        meta = KVCodecMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self.config.save:
            self._update_blocks(scheduler_output)
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                meta.saves.extend(self._plan_saves(req_id, n))
        return meta

    def _update_blocks(self, out: "SchedulerOutput") -> None:
        for new in out.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                tracked.computed = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                tracked.block_ids = list(new_ids[0])  # a resumed request gets all its blocks anew
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            tracked.computed = cached.num_computed_tokens[i]

    def _plan_saves(self, req_id: str, scheduled: int) -> list[SaveSpec]:
        tracked = self._requests.get(req_id)
        if tracked is None:
            return []
        done = tracked.computed + scheduled
        ready = min(done // self.chunk, len(tracked.hashes))
        saves = []
        for c in range(tracked.next_save, ready):
            if self._claim_save(tracked.hashes[c]):
                slots = self._slots(tracked.block_ids, c * self.chunk, (c + 1) * self.chunk)
                saves.append(SaveSpec(req_id, tracked.hashes[c], slots))
        tracked.next_save = max(tracked.next_save, ready)
        return saves

    def _claim_save(self, chunk_hash: str) -> bool:
        now = time.monotonic()
        claimed = self._recently_saved.get(chunk_hash)
        if claimed is not None and now - claimed < RECENT_SAVE_S:
            self.stats.add(saves_deduplicated=1)
            return False
        if self.store.is_down:  # the worker will drop this save: let the next request try again
            self._recently_saved.pop(chunk_hash, None)
            return True
        self._recently_saved[chunk_hash] = now
        self._recently_saved.move_to_end(chunk_hash)
        if len(self._recently_saved) > RECENT_SAVES:
            self._recently_saved.popitem(last=False)
        return True

    def request_finished(self, request: "Request") -> None:
        self._requests.pop(request.request_id, None)

    def shutdown(self) -> None:
        self.store.close()
