"""Work the connector does after the engine's last step (chunk saves, upgrades), and vLLM stepping for it.

Why: the connector's counters reach vLLM's front end (its ``/metrics`` and
``KV Transfer metrics:`` line) only with an engine step, and an idle vLLM
engine does not step: it blocks until a request arrives. Saves queued by the
last request, and upgrades its loads started, end after that step, so
``/metrics`` showed none of them until the next request (1 upgraded object of
18). vLLM's hook for a connector with work in flight,
``has_pending_push_work``, keeps the engine stepping: each idle step collects
the workers' counters, and each waits up to ``IDLE_POLL_S`` on the worker for
that work to progress (so the engine polls, it does not spin).

- **How the scheduler knows.** Each worker report carries how many saves and
  upgrades the worker has in flight, in every step while there are any and
  once more when they reach zero (a worker that says nothing has none).
- **For how long.** At most ``shutdown_flush_s`` after the engine's last step
  that computed tokens: a store that hangs must not keep an idle engine
  polling for ever (what it still does is counted with the next request).
- **At shutdown** vLLM drains (``--shutdown-timeout`` > 0) while this hook
  says there is work, so saves still queued when the engine stopped
  computing are stored while it still runs, and counted on ``/metrics``. The
  worker's own flush at teardown waits for what is left of the same
  ``shutdown_flush_s``: whatever the path, queued saves get ``shutdown_flush_s``
  from the engine's last computing step, no more (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
  then bounds nothing the connector waits for).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from vllm_kvcodec.save.saver import SaveCounts

logger = logging.getLogger("vllm_kvcodec")


class KeepStepping:
    """The scheduler side: whether vLLM should step an idle engine for the workers' background work."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.in_flight = 0  # saves and upgrades the workers reported in flight, summed
        self._idle_since: float | None = None  # when the engine last went idle (None: it computes)
        self._said = False  # the end of the window was logged for this idle stretch

    def step(self, idle: bool) -> None:
        """A step was planned: ``idle`` when it schedules no tokens."""
        if not idle:
            self._idle_since, self._said = None, False
        elif self._idle_since is None:
            self._idle_since = time.monotonic()

    def reported(self, in_flight: int | None) -> None:
        """A report of the workers' background work (None: they told nothing new)."""
        if in_flight is not None:
            self.in_flight = in_flight

    def wanted(self) -> bool:
        """``has_pending_push_work``: the workers have work in flight, and the window since the engine went idle
        is not over."""
        if not self.in_flight:
            return False
        if self._idle_since is None or time.monotonic() - self._idle_since < self.window_s:
            return True
        if not self._said:
            self._said = True
            logger.info("kvcodec: %d chunk save(s) or upgrade(s) still in flight %.0f s (shutdown_flush_s) after the "
                        "engine's last step; vLLM stops stepping for them, and their counters reach /metrics with "
                        "the next request", self.in_flight, self.window_s)
        return False


class BackgroundTally:
    """The worker side: what to report of the work in flight, the idle polls that wait for it, and where the
    engine's idle stretch began (when, and the saver's counts then: what the shutdown line counts from)."""

    def __init__(self, in_flight: Callable[[], int], counts: Callable[[], SaveCounts]) -> None:
        self._in_flight, self._counts = in_flight, counts
        self._progress = threading.Event()
        self._told = 0
        self.idle_since: float | None = None
        self.idle_mark: SaveCounts | None = None

    def progressed(self) -> None:
        """A save or an upgrade ended (any thread)."""
        self._progress.set()

    def step(self, idle: bool) -> None:
        """The step's end on the worker: ``idle`` when vLLM scheduled no tokens."""
        if not idle:
            self.idle_since, self.idle_mark = None, None
        elif self.idle_since is None:
            self.idle_since, self.idle_mark = time.monotonic(), self._counts()

    def wait(self, timeout_s: float) -> None:
        """In an idle step: wait up to ``timeout_s`` for work in flight to progress (vLLM steps again at once
        otherwise, and would spin while the work runs); no wait when there is none."""
        self._progress.clear()
        if self._in_flight():
            self._progress.wait(timeout_s)

    def report(self) -> int | None:
        """The count to report: every step while work is in flight, once more when it ended; None otherwise."""
        now = self._in_flight()
        if not now and not self._told:
            return None
        self._told = now
        return now

    def window_left(self, window_s: float) -> float:
        """Of ``window_s`` from the engine's last computing step, what is left (all of it while it computes)."""
        if self.idle_since is None:
            return window_s
        return max(0.0, window_s - (time.monotonic() - self.idle_since))
