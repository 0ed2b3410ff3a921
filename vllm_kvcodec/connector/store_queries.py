"""What a lookup asks the store: which chunks are stored whole, and which block refs name stored objects.

Called inline (``lookup: sync``) or from the lookup thread (:mod:`~.lookup`),
never with anything the scheduler's own thread must wait for beyond the
call. A store that does not answer is a miss (counted), never an error: the
request computes its prefix instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

from storage import Store, StoreError
from storage.outage import StoreDownError
from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.keys.block_refs import Ref, parse_ref, ref_key
from vllm_kvcodec.keys.chain import Namespace, chunk_object_keys
from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")
_T = TypeVar("_T")


class StoreQueries:
    def __init__(self, store: Store, namespace: Callable[[str], Namespace], tp_size: int, groups: int, chunk: int,
                 stats: ConnectorStats) -> None:
        """``namespace``: the scheduler half's namespace of a precision as it is now (an fp8 cache's is completed at
        the handshake; a request demanding lossless asks the lossless one, see connector/precisions.py)."""
        self.store, self._namespace, self.stats = store, namespace, stats
        self.tp_size, self.groups, self.chunk = tp_size, groups, chunk

    def stored(self, hashes: list[str], precision: str = LOSSLESS) -> list[bool] | None:
        """Per chunk (or tail) key of ``precision``'s namespace, whether every object of it (all ranks, all layer
        groups) is in the store; None when the store did not answer (counted: a miss)."""
        if not hashes:
            return []
        namespace = self._namespace(precision)
        keys = [chunk_object_keys(namespace, h, self.tp_size, self.groups) for h in hashes]
        found = self._ask(lambda: self.store.exists_many([k for ks in keys for k in ks]),
                          "store lookup failed, computing the prefix instead")
        if found is None:
            return None
        per = len(keys[0])
        return [all(found[c * per : (c + 1) * per]) for c in range(len(hashes))]

    def resolve(self, prefixes: list[str], precision: str = LOSSLESS) -> list[Ref | None] | None:
        """Per whole-block prefix, its ref if one is stored and every object it names is (two store calls);
        None when the store did not answer (counted: a miss).

        A ref whose object is gone while the tail stored under the ref's own
        prefix (exactly its tokens) is not, leads to that tail: the same
        existence check asks for both.
        """
        namespace = self._namespace(precision)
        blobs = self._ask(lambda: self.store.get_many([ref_key(namespace, h) for h in prefixes]),
                          "reading block refs failed, computing those blocks instead")
        if blobs is None:
            return None
        refs = [parse_ref(b, h, self.chunk) for b, h in zip(blobs, prefixes)]
        self.stats.add(refs_read=sum(b is not None for b in blobs), refs_invalid=sum(
            b is not None and r is None for b, r in zip(blobs, refs)))
        own = {h: Ref(h, r.prefix_tokens, r.prefix_tokens) for h, r in zip(prefixes, refs)
               if r is not None and r.chunk_hash != h}
        targets = list(dict.fromkeys([r.chunk_hash for r in refs if r is not None] + list(own)))
        held = dict(zip(targets, self.stored(targets, precision) or [False] * len(targets))) if targets else {}
        out = []
        for h, r in zip(prefixes, refs):
            if r is not None and not held[r.chunk_hash] and h in own and held[h]:
                self.stats.add(refs_to_own_tail=1)  # the object it named is gone, the tail under its prefix is not
                r = own[h]
            out.append(r if r is not None and held[r.chunk_hash] else None)
        return out

    def probe(self) -> Callable[[], list[bool]]:
        """An existence check of a chunk key no prompt has: what an empty lookup costs the store (lookup auto)."""
        keys = chunk_object_keys(self._namespace(LOSSLESS), os.urandom(16).hex(), self.tp_size, self.groups)
        return lambda: self.store.exists_many(keys)

    def _ask(self, call: Callable[[], _T], failure: str) -> _T | None:
        """A lookup's store call; None (counted: a miss) when the store did not answer."""
        try:
            return call()
        except StoreDownError:  # known outage, already logged once: a miss at no cost
            self.stats.add(lookup_failures=1, lookups_store_down=1)
        except StoreError as exc:
            self.stats.add(lookup_failures=1)
            logger.warning("kvcodec: %s: %s", failure, exc)
        return None
