"""De-duplication of saves: which chunks this instance has already handed to a worker for saving.

A burst of requests sharing a new prefix looks it up before the first save
lands, and must not encode and put it once per request. A chunk is *claimed*
when a save of it is planned; the claim is released when the worker reports
that the save did not land (dropped by the memory cap or an outage, failed,
or computed over a failed load), so the next request that computes the chunk
saves it again (the scheduler half also wakes the requests that skipped the
chunk for the claim and still hold it), and it expires after ``CLAIM_TTL_S``
in case the report is lost. A landed save keeps its claim until then: later
lookups find the chunk.
"""

from __future__ import annotations

import collections
import time

#: Claims remembered at most (chunk hashes, about 2 MB).
MAX_CLAIMS = 1 << 16
#: How long a claim suppresses another save of its chunk without a report.
CLAIM_TTL_S = 60.0


class SaveClaims:
    def __init__(self, ttl_s: float = CLAIM_TTL_S, capacity: int = MAX_CLAIMS) -> None:
        self.ttl_s, self.capacity = ttl_s, capacity
        self._claims: collections.OrderedDict[str, float] = collections.OrderedDict()

    def claim(self, chunk_hash: str) -> bool:
        """True if the caller should save ``chunk_hash`` (nobody holds a live claim on it)."""
        now = time.monotonic()
        claimed = self._claims.get(chunk_hash)
        if claimed is not None and now - claimed < self.ttl_s:
            return False
        self._claims[chunk_hash] = now
        self._claims.move_to_end(chunk_hash)
        if len(self._claims) > self.capacity:
            self._claims.popitem(last=False)
        return True

    def release(self, chunk_hash: str) -> None:
        """The save did not land: the next request that computes the chunk should save it."""
        self._claims.pop(chunk_hash, None)

    def __contains__(self, chunk_hash: str) -> bool:
        claimed = self._claims.get(chunk_hash)
        return claimed is not None and time.monotonic() - claimed < self.ttl_s
