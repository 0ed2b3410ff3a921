"""vLLM's real Scheduler keeps stepping an idle engine for the worker's saves in flight, and for no longer than
``shutdown_flush_s`` (see background_work.py).

On :mod:`tests.support.scheduler_harness` (real scheduler and worker half,
real file store); the store's writes are held at a gate, as a slow or hung
store would hold them, so the saves are in flight when the requests are done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from storage.base import Store
from tests.support.scheduler_harness import Engine, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class GatedWrites(Store):
    """Passes every call to the real store; writes wait until the gate opens."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.gate = threading.Event()

    def _put(self, key: str, value: memoryview) -> None:
        self.gate.wait(60)
        self.inner.put(key, value)

    def _get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def _exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _keys(self, prefix: str) -> Iterator[str]:
        return self.inner.keys(prefix)


def gate_writes(e: Engine) -> GatedWrites:
    guard = e.worker.worker.store
    guard.inner = gated = GatedWrites(guard.inner)
    return gated


def idle_steps_while_stepped_for(e: Engine, limit: int = 2000) -> int:
    """Idle steps, as vLLM's busy loop takes them, while its scheduler has anything to step for."""
    for n in range(limit):
        if not e.scheduler.has_requests():
            return n
        e.step()
    raise AssertionError(f"still stepping after {limit} idle steps")


@pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])
def test_vllm_steps_the_idle_engine_until_the_saves_land(tmp_path, store, pipelined) -> None:
    e = Engine(tmp_path, store, async_scheduling=pipelined)
    gated = gate_writes(e)
    e.add("r", prompt(100), max_tokens=2)  # three chunks of 32 tokens to save
    e.run()
    assert e.scheduler.has_requests(), "vLLM would stop stepping with the saves in flight"
    e.step()
    assert e.steps[-1].report.background > 0
    assert "saved_chunks" not in e.stats()
    gated.gate.set()
    assert idle_steps_while_stepped_for(e) >= 1
    assert e.stats()["saved_chunks"] == 3
    told = [s.report.background for s in e.steps if s.report is not None and s.report.background is not None]
    assert told[-1] == 0 and all(told[:-1]), told  # every step while saves were in flight, then their end once
    e.assert_empty()


def test_a_store_that_hangs_is_stepped_for_shutdown_flush_s_at_most(tmp_path, store, caplog) -> None:
    caplog.set_level(logging.INFO, logger="vllm_kvcodec")
    e = Engine(tmp_path, store, shutdown_flush_s=0.5)
    gated = gate_writes(e)
    e.add("r", prompt(100), max_tokens=2)
    e.run()
    assert e.scheduler.has_requests()
    idle_steps_while_stepped_for(e)
    assert e.worker.worker.saver.in_flight() > 0 and not e.scheduler.has_requests()
    assert any("still in flight" in r.getMessage() for r in caplog.records)
    gated.gate.set()
    e.assert_empty()
