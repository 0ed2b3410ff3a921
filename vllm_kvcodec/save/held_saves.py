"""Saves that wait for every worker's outcome of the loads they were computed after.

A chunk computed in the step of a load rests on that load's KV on *every*
worker: under tensor parallelism attention's output is all-reduced over the
ranks, under pipeline parallelism a stage's output feeds the next. A load
that fails on one rank only makes every rank's KV of the later tokens wrong,
yet each worker knows only its own outcome. Were a worker whose own load
landed to store the chunk at once, a replicated cache (MLA's latent, written
by rank 0 alone) would be complete and wrong, and a split cache could be made
whole by an older copy of the failing rank's shard.

So where more than one worker runs each load, a gathered chunk that names
loads whose outcome the scheduler half had not heard from every worker
(``SaveSpec.unsettled_loads``) is *held*: out of paged memory, its bytes still
counted against the save budget, nothing written. The scheduler half settles a
load once every worker reported it and sends each settled load's verdict in
the next plan (``KVCodecMetadata.settled_loads``); a chunk whose loads all
landed is then encoded and stored, one whose load failed anywhere is dropped
and reported as not landed (the request recomputes it and saves it then).
Verdicts are remembered for a while, so a hold that reaches the saver after
its verdict is settled at once. A hold that no verdict settles within
``ttl_s`` (a lost report) is dropped.

What a reader sees meanwhile: nothing. The chunk is a miss until its verdict,
a step or two after it was computed, and then the same object it would have
been, or none.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

#: Verdicts remembered for holds that arrive after them (load ids; a few KB).
MAX_VERDICTS = 4096
#: How long past the load timeout a hold waits for its verdict: a step or two after the slowest worker reported,
#: so a hold older than this lost its report (the scheduler half expires such loads at the timeout plus 10 s).
HOLD_SLACK_S = 60.0


@dataclasses.dataclass
class Held:
    """One gathered chunk waiting for the outcome of ``loads`` (the Saver's arguments for it, kept as they are)."""

    job: Any
    loads: set[int]
    since: float


class Released(NamedTuple):
    """Held jobs a settlement decided: to store (every load landed), to drop (a load failed somewhere), expired."""

    ready: list[Any]
    failed: list[Any]
    expired: list[Any]


class HeldSaves:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._held: list[Held] = []
        self._verdicts: collections.OrderedDict[int, bool] = collections.OrderedDict()  # load id -> failed

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, job: Any, loads: Collection[int]) -> Released:
        """Hold ``job`` until ``loads`` are settled (at once, if verdicts already known settle it)."""
        self._held.append(Held(job, set(loads), time.monotonic()))
        return self.settle({})

    def settle(self, verdicts: Mapping[int, bool]) -> Released:
        """Record ``verdicts`` (load id -> failed on some worker) and release the jobs they, or the TTL, decide."""
        for load_id, failed in verdicts.items():
            self._verdicts[load_id] = failed
            self._verdicts.move_to_end(load_id)
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)
        out, kept = Released([], [], []), []
        oldest = time.monotonic() - self.ttl_s
        for held in self._held:
            known = held.loads & self._verdicts.keys()
            if any(self._verdicts[i] for i in known):
                out.failed.append(held.job)
            elif known == held.loads:
                out.ready.append(held.job)
            elif held.since < oldest:
                out.expired.append(held.job)
            else:
                kept.append(held)
        self._held = kept
        return out

    def take_all(self) -> list[Any]:
        """Every job still held (shutdown: no verdict will come)."""
        held, self._held = self._held, []
        return [h.job for h in held]
