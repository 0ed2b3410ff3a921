"""Upgrade hot objects that were stored with the saver's fallback codec to the configured one.

A saver that falls behind the engine stores chunks with the cheaper codec
(``save_codec_when_behind``: splitzip, 1.33x on real KV against rans's 1.51x),
and without this those objects keep the lower ratio for as long as the store
keeps them: a store filled in bursts stays a splitzip store. A load proves an
object worth the CPU: when one arrives coded with the fallback codec and the
saver has nothing queued, the bytes just fetched (validated by the load) are
re-encoded here, checked to decode to the same bits, and written over the
same key. Keys are content addressed, so a reader sees either version, both
exact; the engine never waits on any of it.

Never over a newer object: the write is the store's conditional
``replace``, made only if the key still holds the very bytes the load read.
A save of the key since then (this instance's or another's, whatever its
codec), or its deletion or eviction, stays as it is
(``upgrades_superseded``). Where the store compares and writes atomically
(memory, Redis: WATCH/MULTI/EXEC) nothing is left of the race; the file store
checks that its path still names the file it compared just before renaming
the new one into place, so a put renamed into place between that ``stat`` and
the rename is overwritten, and Mooncake, which has no conditional write,
compares a ``get`` with what was read and then upserts (a save landing within
that round trip is overwritten). What such a lost save held is the same KV
(same key, bit-exact re-encoding), in its codec.

Bounds: one thread at the lowest CPU priority (nice 19: on a CPU engine it
takes the cycles the engine leaves, about 1.5% of a core the engine wants,
by the scheduler's weights), at most
:data:`MAX_PENDING_BYTES` of fetched objects held, an object is offered at
most once per process, and nothing is taken or written while the saver has
work (its own chunks come first) or the store is down.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from storage import Store
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.format import ChunkHeader, decode_chunk, decode_payload, encode_chunk, read_header
from vllm_kvcodec.save.saver import yield_to_engine
from vllm_kvcodec.stats import ConnectorStats
from vllm_kvcodec.runtime.threads import started_pool

logger = logging.getLogger("vllm_kvcodec")
#: Fetched object bytes held for upgrading at once (what a burst of hits on fallback-coded objects may pin).
MAX_PENDING_BYTES = 64 << 20
#: The upgrade thread's nice increment: the lowest priority, so it never competes with the engine or the saver.
UPGRADE_NICE = 19
#: Keys remembered as offered, so a hot object is re-encoded once, not once per hit.
REMEMBERED_KEYS = 1 << 16


class Upgrader:
    def __init__(self, store: Store, chooser: CodecChooser, saver_idle: Callable[[], bool], stats: ConnectorStats,
                 max_pending_bytes: int = MAX_PENDING_BYTES, ended: Callable[[], None] = lambda: None) -> None:
        """``ended``: called (on the upgrade thread) after each upgrade, done or not."""
        self.store, self.chooser, self.saver_idle, self.stats = store, chooser, saver_idle, stats
        self.ended = ended
        self.max_pending = max_pending_bytes
        self._lock = threading.Lock()
        self._pending = 0
        self._offered: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._futures: set[Future] = set()
        self._pool = started_pool(1, "kvcodec-upgrade", yield_to_engine, (UPGRADE_NICE,))

    def offer(self, key: str, blob: bytes | bytearray | memoryview, header: ChunkHeader) -> bool:
        """A loaded object: queue it for upgrading if it is fallback-coded and the saver is idle (never raises)."""
        behind = self.chooser.behind
        if behind is None or header.codec_id != behind.codec_id or header.codec_id == self.chooser.current_id:
            return False
        if not self._idle():
            self.stats.add(upgrades_skipped_busy=1)
            return False
        with self._lock:
            if key in self._offered or self._pending + len(blob) > self.max_pending:
                return False
            self._remember(key)
            self._pending += len(blob)
            held = bytes(blob)  # the fetcher's buffer may be reused once the load is done
            future = self._pool.submit(self._upgrade, key, held)
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return True

    def _remember(self, key: str) -> None:
        self._offered[key] = None
        while len(self._offered) > REMEMBERED_KEYS:
            self._offered.popitem(last=False)

    def _idle(self) -> bool:
        return self.saver_idle() and not self.store.is_down

    def _upgrade(self, key: str, blob: bytes) -> None:
        try:
            if not self._idle():  # saves arrived meanwhile: theirs is the CPU; a later hit offers it again
                self.stats.add(upgrades_skipped_busy=1)
                self._unremember(key)
                return
            header = read_header(blob, key=key)
            kv = decode_payload(blob, header)
            codec = self.chooser.codec_for(kv)
            if codec.codec_id == header.codec_id:
                return
            new = encode_chunk(kv, codec, key=key, tokens=header.tokens)  # what it records of its tokens, too
            if not _same_bits(decode_chunk(new, key=key), kv):
                raise RuntimeError(f"{codec.codec_id} did not reproduce the stored KV")  # never overwrite with it
            if len(new) >= len(blob):
                self.stats.add(upgrades_not_smaller=1)
                return
            if not self.store.replace(key, blob, new):  # saved anew, or gone, since the load read it: that stays
                self.stats.add(upgrades_superseded=1)
                return
            self.stats.add(upgraded_objects=1, upgraded_bytes_before=len(blob), upgraded_bytes_after=len(new),
                           upgraded_bytes_saved=len(blob) - len(new),
                           **{f"codec_{codec.codec_id}_upgrades": 1})
        except Exception as exc:  # noqa: BLE001 - the stored object stays as it was: correct, less dense
            self.stats.add(upgrade_failures=1)
            logger.warning("kvcodec: upgrading %s failed, keeping it as stored: %s", key, exc)
        finally:
            with self._lock:
                self._pending -= len(blob)

    def _unremember(self, key: str) -> None:
        with self._lock:
            self._offered.pop(key, None)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
        self.ended()

    def in_flight(self) -> int:
        """Upgrades queued or running."""
        with self._lock:
            return len(self._futures)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued upgrades (tests, benchmarks); True if all finished."""
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            try:
                f.result(timeout=timeout)
            except TimeoutError:
                return False
        return True

    def shutdown(self) -> None:
        """Drop queued upgrades: each is an optimisation, and the stored objects are correct as they are."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.reshape(-1).view(torch.uint8),
                                                                          b.reshape(-1).view(torch.uint8)))
