"""Blocks of vLLM's paged memory that hold lossy KV: kept from requests that must not read it.

vLLM's prefix cache shares blocks between requests by their tokens alone; it
knows nothing of precision. A lossy load (LOSSY: NOT BIT-EXACT) writes its
blocks, and the request goes on computing KV over them, block after block;
vLLM caches all of them like any other. Taken as a local hit by another
request, they would hand it lossy KV behind the connector's back:

- a request that demands lossless (on a lossy server, or under ``auto``)
  would not get "exactly today's behaviour": before the connector answers
  it, the lossy blocks of its local hit are evicted from vLLM's prefix cache
  (they keep their refcounts; the request that holds them runs on) and vLLM
  is asked to look again next step, when its local hit ends before them;
- any other request holds lossy KV from the first such block on
  (:meth:`~.request_state.RequestState.holds_lossy`): under ``auto`` its
  later chunks are not saved, since a lossless object is the ground truth.

The scheduler half records the blocks of every request holding lossy KV from
its first lossy token on, each step (a sync load's blocks are cached at
allocation, so also when its load is planned). An entry stays until it is
evicted here: a block vLLM freed and reused for exact KV costs at most one
needless eviction and a step's wait, never a lossy hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.connector.request_state import RequestState
from vllm_kvcodec.stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager


class LossyBlocks:
    def __init__(self, block_sizes: list[int], stats: ConnectorStats) -> None:
        self.block_sizes, self.stats = block_sizes, stats
        self._blocks: list[set[int]] = [set() for _ in block_sizes]  # per KV cache group

    def __bool__(self) -> bool:
        return any(self._blocks)

    def mark(self, state: RequestState) -> None:
        """Every block ``state`` holds from its first lossy token on (none while it holds no lossy KV)."""
        if state.lossy_from is None:
            return
        for blocks, table, bs in zip(self._blocks, state.block_ids, self.block_sizes):
            blocks.update(b for b in table[state.lossy_from // bs :] if b != 0)  # 0: vLLM's null block

    def screen(self, state: RequestState, manager: "KVCacheManager | None") -> bool:
        """Before the connector answers ``state``: False to answer now; True to have vLLM ask again next step (its
        local hit held lossy blocks, now evicted: it demands lossless). A request that accepts lossy KV and got
        some as its local hit is told it holds lossy KV from there."""
        if not self or not state.local_tokens or manager is None:
            return False
        hit = state.local_hit_blocks(manager)
        lossy = [[b for b in group if b in blocks] for group, blocks in zip(hit, self._blocks)]
        if not any(lossy):
            return False
        if state.precision != LOSSLESS:
            state.holds_lossy(min(group.index(found[0]) * bs for group, found, bs in zip(hit, lossy, self.block_sizes)
                                  if found))
            return False
        evict = {b for found in lossy for b in found}
        manager.evict_blocks(evict)
        for blocks, found in zip(self._blocks, lossy):
            blocks.difference_update(found)
        self.stats.add(lossy_blocks_evicted=len(evict))
        return True
