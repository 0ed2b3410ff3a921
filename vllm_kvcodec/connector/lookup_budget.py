"""How long vLLM's scheduler may wait for the store in one step, and whether waiting is worth it (``lookup: auto``).

Why: the lookup thread (:mod:`~.lookup`) keeps a slow store off the
scheduler's loop, but its contract makes every new request with something
to ask wait one engine step before it is admitted. On a store that answers
in a fraction of a millisecond that step costs more than the round trip it
saves: a saving server on loopback Redis ran at 0.91-0.94x the throughput
of a server without the connector, against 1.02x with inline lookups. So
``auto`` waits for the thread's answer within the step, while what a lookup
costs fits the step's budget, and does not wait at all while it does not.

- **The budget** of a step is the larger of ``lookup_budget_ms`` and
  ``lookup_budget_share`` of the engine's recent step time (the median of
  the last :data:`STEPS` steps that ran something). A GPU engine's steps
  last tens of milliseconds, where 1 ms is a few percent; a CPU engine's
  last a second, where 1 ms answers two lookups of a burst that would fill
  the step.
- **What a lookup costs** is the time the store took to answer the
  thread's batches: the median of the last :data:`SAMPLES` (at start, a
  probe of empty existence checks, whose first pays for a cold connection
  or cache), or the last one if that was slower (one fast answer proves
  little, one slow one is reason enough not to wait), and, while the
  thread is answering one, how long it has been at it: a store that starts
  to hang is seen within the step, not after ``lookup_timeout_s``.
- **Inline** (the step waits, up to what is left of its budget) while that
  cost is within the budget; **on the thread** (nobody waits) past it; back
  once the cost is under half the budget, so a store near the budget does
  not flip the choice every step. The choice starts on the thread, is
  logged when first made and at every switch, and exported (switches, steps
  per mode, seconds waited).
- **A store that does not answer** (down: the outage guard refuses each
  call at once; or erring) is not measured: a refusal in 0.1 ms says
  nothing of how fast the store answers. Until it answers again nothing
  moves lookups back within the step (they stay where they are, or go to
  the thread if a call hangs), so every logged figure is an answer time.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time

from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")

#: Steps the engine's step time is the median of.
STEPS = 16
#: Batches (and start-up probes) a lookup's cost is the median of.
SAMPLES = 5
#: Back to inline once a lookup costs at most this share of the budget (it left inline above all of it).
HYSTERESIS = 0.5


class LookupBudget:
    """The scheduler thread's view: the step's budget, the cost of a lookup, and whether to wait for answers.

    Everything runs on the scheduler thread but :meth:`answering`, which
    the lookup thread calls around each batch (one attribute written, read
    whole by :meth:`cost`).
    """

    def __init__(self, stats: ConnectorStats, *, floor_s: float, share: float) -> None:
        self.stats = stats
        self.floor_s, self.share = floor_s, share
        self.budget_s = floor_s
        self.inline = False  # until a lookup's cost is known
        self._costs: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self._busy_since: float | None = None
        self._decided = False
        self._spent = 0.0
        self._steps: collections.deque[float] = collections.deque(maxlen=STEPS)
        self._last_end: float | None = None
        self._last_ran = False
        self._unanswered = False  # the store's last batch got no answer: not back within the step until one does

    # ---- lookup thread ------------------------------------------------------------
    def answering(self, since: float | None) -> None:
        """The lookup thread started answering a batch at ``since`` (monotonic), or (None) finished."""
        self._busy_since = since

    # ---- scheduler thread ---------------------------------------------------------
    def observe(self, seconds: float) -> None:
        """The store answered a batch (or the start-up probe) in ``seconds``."""
        self._unanswered = False
        self._costs.append(seconds)
        self.stats.sample(lookup_s=seconds)
        self.choose()

    def unanswered(self) -> None:
        """The store did not answer a batch (or the probe): no sample, and no way back within the step for now."""
        self._unanswered = True

    def cost(self) -> float | None:
        """Seconds a lookup costs the store, as far as known: at least as long as the batch in the thread has taken."""
        busy = self._busy_since
        age = time.monotonic() - busy if busy is not None else 0.0
        if not self._costs:
            return age or None
        return max(statistics.median(self._costs), self._costs[-1], age)

    def wait_left(self) -> float:
        """Seconds the scheduler may still wait for answers in this step (0 on the thread)."""
        return max(0.0, self.budget_s - self._spent) if self.inline else 0.0

    def waited(self, seconds: float) -> None:
        self._spent += seconds
        self.stats.add(lookup_wait_s=seconds)

    def step_ended(self, ran: bool, asked: bool) -> None:
        """End of a scheduler step (``ran``: it scheduled tokens; ``asked``: it had lookups): a fresh budget."""
        now = time.monotonic()
        if self._last_end is not None and self._last_ran:
            self._steps.append(now - self._last_end)
        self._last_end, self._last_ran = now, ran
        if asked:
            self.stats.add(**({"lookup_steps_inline": 1} if self.inline else {"lookup_steps_thread": 1}))
        self._spent = 0.0
        self.budget_s = max(self.floor_s, self.share * statistics.median(self._steps)) if self._steps else self.floor_s
        self.choose()

    def choose(self) -> None:
        cost = self.cost()
        if cost is None or (self._unanswered and not self._decided):
            return
        if self.inline and cost > self.budget_s:
            self._switch(False, cost)
        elif not self.inline and cost <= self.budget_s * HYSTERESIS and not self._unanswered:
            self._switch(True, cost)
        elif not self._decided:
            self._switch(self.inline, cost)

    def _switch(self, inline: bool, cost: float) -> None:
        if self._decided and inline != self.inline:
            self.stats.add(**({"lookup_mode_switches_inline": 1} if inline else {"lookup_mode_switches_thread": 1}))
        self.inline, self._decided = inline, True
        if inline:
            logger.info("kvcodec: lookups answered within the step: the store answers one in %.2f ms, within the "
                        "step's budget of %.2f ms", cost * 1e3, self.budget_s * 1e3)
        else:  # a first choice stays on the thread from half the budget on (see HYSTERESIS)
            logger.info("kvcodec: lookups on the lookup thread (answered the next step): the store takes %.2f ms a "
                        "lookup, %s the step's budget of %.2f ms", cost * 1e3,
                        "over" if cost > self.budget_s else "over half of", self.budget_s * 1e3)
