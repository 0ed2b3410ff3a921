"""Run blocking client calls on worker threads, and stop waiting for them after a deadline.

Why: a store call sits on the prefill path, where a hung store is worse than a
miss, and some clients cannot be told to give up. Mooncake's client waits 30 s
for a master that stopped answering, and its ``setup`` retries an absent master
for about 90 s. So each call runs on a worker thread while the caller waits at
most ``timeout_s``, then raises :class:`~storage.errors.StoreUnavailableError`.

The call itself cannot be cancelled; it finishes (or fails) on its worker later.
A job whose caller gave up before a worker picked it up is skipped, so a backlog
built during an outage is not replayed when the store returns. Workers are
daemon threads: a call stuck in the client never keeps the process from exiting.
At most ``workers`` calls run at once; beyond that, calls wait their turn within
their own deadline.

Closing waits for the calls still running before it releases what they use:
Mooncake's client crashes the process (SIGSEGV) when it is closed under a call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from storage.errors import StoreUnavailableError

_T = TypeVar("_T")


class _Job(Generic[_T]):
    def __init__(self, fn: Callable[[], _T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.abandoned = False
        self.result: _T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        if self.abandoned:
            return
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the waiting caller
            self.error = exc
        finally:
            self.done.set()


class Deadline:
    """``call(fn, what)`` returns ``fn()`` or raises StoreUnavailableError after ``timeout_s``."""

    def __init__(self, timeout_s: float, *, workers: int = 8, name: str = "kvcodec-store") -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._active = 0  # jobs queued or running
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def call(self, fn: Callable[[], _T], what: str) -> _T:
        job: _Job[_T] = _Job(fn)
        with self._idle:
            if self._closed:
                raise StoreUnavailableError(f"{what}: the store is closed")
            self._active += 1
        self._jobs.put(job)
        if not job.done.wait(self.timeout_s):
            job.abandoned = True
            raise StoreUnavailableError(f"{what} did not answer within {self.timeout_s:g} s")
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def close(self, finalizer: Callable[[], object] | None = None) -> bool:
        """Refuse new calls; once the running ones returned (within ``timeout_s``), run ``finalizer`` (bounded too).

        False, and ``finalizer`` not run, when a call is still running: what it uses must outlive it.
        Without a finalizer nothing is waited for.
        """
        with self._idle:
            self._closed = True
            idle = finalizer is None or self._idle.wait_for(lambda: self._active == 0, self.timeout_s)
        if finalizer is not None and idle:
            final = threading.Thread(target=finalizer, name="kvcodec-store-close", daemon=True)
            final.start()
            final.join(self.timeout_s)
        for _ in self._threads:
            self._jobs.put(None)
        return idle

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.run()
            finally:
                with self._idle:
                    self._active -= 1
                    self._idle.notify_all()
