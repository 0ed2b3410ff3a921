"""Asynchronous lookup in vLLM's real Scheduler: the try-again flow, one store call per step, shared probes,
requests that end before their answer, and stores that hang or fall behind.

Scenarios run on :mod:`tests.support.scheduler_harness` (real scheduler, real
worker half, real file store, a fake model whose KV is checked bit for bit).
Store calls are counted by a real pass-through store wrapped around the
scheduler half's store; a hanging store is the link emulator with a round
trip far beyond ``lookup_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.base import Store
from tests.support.scheduler_harness import Engine, loaded_tokens, loads_of, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class CountingStore(Store):
    """Passes every call to the real store, and records each existence check (the keys of each call)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.checks: list[list[str]] = []

    def _exists_many(self, keys: list[str]) -> list[bool]:
        self.checks.append(list(keys))
        return self.inner.exists_many(keys)

    def _exists(self, key: str) -> bool:
        self.checks.append([key])
        return self.inner.exists(key)

    def _get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def _put(self, key: str, value: memoryview) -> None:
        self.inner.put(key, value)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _keys(self, prefix: str) -> Iterator[str]:
        return self.inner.keys(prefix)


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["sched", "async-sched"])


def make(tmp_path: Path, store: str, pipelined: bool = False, **kw: Any) -> Engine:
    kw.setdefault("lookup", "async")
    return Engine(tmp_path, store, async_scheduling=pipelined, **kw)


def stored(tmp_path: Path, store: str, *prompts: list[int], **kw: Any) -> None:
    e = make(tmp_path, store, lookup="sync", **kw)
    for i, tokens in enumerate(prompts):
        e.add(f"producer{i}", tokens, max_tokens=1)
    e.run()
    e.flush()
    e.assert_empty()
    e.shutdown()


def count_checks(engine: Engine) -> CountingStore:
    guard = engine.connector.scheduler.store
    guard.inner = counting = CountingStore(guard.inner)
    return counting


@SCHEDULING
def test_first_ask_answers_none_and_the_next_step_loads(tmp_path, store, pipelined) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store, pipelined=pipelined)
    assert e.connector.scheduler.lookup_mode == "async"
    e.add("r", p[:290], max_tokens=3)
    asked = e.step()
    assert not asked.scheduled and not asked.loads, "scheduled before the store answered"
    assert e.scheduler.requests["r"].status.name == "WAITING"
    assert e.scheduler_stats()["lookup_retries"] == 1 and "lookups" not in e.scheduler_stats()
    e.run()
    assert loaded_tokens(e, "r") == 288 and e.scheduler_stats()["lookups"] == 1
    e.assert_empty()


@pytest.mark.parametrize("tails", [False, True], ids=["chunks", "prompt-tails"])
def test_one_store_call_per_step_for_all_new_requests(tmp_path, store, tails) -> None:
    """8 requests of different prompts arrive in one step: one exists_many over all their chunks (one more
    for their tails), each key once; each then loads its own prefix."""
    prompts = [prompt(215, seed) for seed in range(8)]  # 6 chunks of 32, a tail of one 16-token block
    stored(tmp_path, store, *prompts, prompt_tails=tails)
    e = make(tmp_path, store, prompt_tails=tails, max_seqs=16, max_batched=4096)
    counting = count_checks(e)
    for i, p in enumerate(prompts):
        e.add(f"r{i}", p, max_tokens=2)
    e.step()
    e.connector.scheduler.lookups.wait_idle(30)
    objects = len(e.worker.worker.groups)
    assert len(counting.checks) == (2 if tails else 1)
    assert len(counting.checks[0]) == 8 * 6 * objects
    e.run()
    assert [loaded_tokens(e, f"r{i}") for i in range(8)] == [208 if tails else 192] * 8
    assert len(counting.checks) == (2 if tails else 1), "the store was asked again after the batch"
    stats = e.scheduler_stats()
    assert stats["lookup_batches"] == 1 and stats["lookup_batch_requests"] == 8
    e.assert_empty()


def test_requests_asking_the_same_share_one_probe(tmp_path, store) -> None:
    """Same chunks: one probe, asked once, across steps while it is in the air."""
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store, max_seqs=16, max_batched=4096, settle_lookups=False)
    counting = count_checks(e)
    release = _hold_checks(counting)
    for i in range(4):
        e.add(f"a{i}", p[:290], max_tokens=2)
    e.step()  # four asks, one probe, submitted (the store holds its answer)
    e.add("late", p[:290], max_tokens=2)
    e.step()  # joins the probe in flight
    release()
    e.run()
    assert len(counting.checks) == 1 and len(counting.checks[0]) == 9 * len(e.worker.worker.groups)
    assert e.scheduler_stats()["lookups_shared"] == 4
    assert sum(loaded_tokens(e, r) for r in ["a0", "a1", "a2", "a3", "late"]) >= 288  # loaded once, then local hits
    e.assert_empty()


def _hold_checks(counting: CountingStore) -> Any:
    """Make the store's existence checks wait until the returned function is called."""
    import threading

    gate = threading.Event()
    inner = counting._exists_many

    def held(keys: list[str]) -> list[bool]:
        gate.wait(30)
        return inner(keys)

    counting._exists_many = held  # type: ignore[method-assign]
    return gate.set


@SCHEDULING
def test_a_request_aborted_before_its_answer_leaves_nothing(tmp_path, store, pipelined) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store, pipelined=pipelined, settle_lookups=False)
    counting = count_checks(e)
    release = _hold_checks(counting)
    e.add("r", p[:290], max_tokens=2)
    e.add("kept", prompt(300, 9), max_tokens=2)
    e.step()  # both asked; the answers are held
    e.abort("r")
    assert e.connector.scheduler.lookups.waiting() == ["kept"]
    release()
    e.run()
    assert not loads_of(e, ["r"]) and loaded_tokens(e, "kept") == 0
    e.assert_empty()


def test_a_request_aborted_before_its_question_was_sent_is_never_asked(tmp_path, store) -> None:
    p = prompt(300)
    stored(tmp_path, store, p)
    e = make(tmp_path, store)
    counting = count_checks(e)
    e.add("r", p[:290], max_tokens=2)
    e.connector.get_num_new_matched_tokens(e.scheduler.requests["r"], 0)  # asked, not yet sent (the step's end)
    e.abort("r")
    e.run()
    assert counting.checks == [] and e.connector.scheduler.lookups.waiting() == []
    e.assert_empty()


def test_a_store_that_hangs_is_a_miss_after_the_timeout(tmp_path) -> None:
    """The store takes 1.5 s a round trip, the lookup gives up after 0.2 s: the request computes, counted."""
    url = f"file://{tmp_path / 'store'}"
    p = prompt(100)
    stored(tmp_path, url, p, layers_per_object=1)
    e = make(tmp_path, f"link+{url}?gbps=10&rtt_ms=1500", layers_per_object=1, save=False, lookup_timeout_s=0.2,
             settle_lookups=False)
    e.add("r", p[:90], max_tokens=2)
    e.run(max_steps=2000)
    stats = e.scheduler_stats()
    assert stats["lookup_timeouts"] == 1 and stats["hit_chunks"] == 0 and not loads_of(e, ["r"])
    assert stats["lookup_retries"] >= 2
    e.assert_empty()


def test_a_full_queue_answers_misses_at_once(tmp_path) -> None:
    """One batch in the thread, one queued (lookup_queue 1): a third step's batch is a miss at once, counted."""
    url = f"file://{tmp_path / 'store'}"
    e = make(tmp_path, f"link+{url}?gbps=10&rtt_ms=1500", layers_per_object=1, save=False, lookup_queue=1,
             lookup_timeout_s=60, settle_lookups=False)
    for i in range(3):
        e.add(f"r{i}", prompt(100, i), max_tokens=2)
        e.step()
        if i == 0:
            _wait(lambda: e.connector.scheduler.lookups._queue.empty())  # the thread took the first batch
    e.step()
    assert e.scheduler_stats()["lookups_queue_full"] == 1 and "r2" in e.steps[-1].scheduled
    e.run(max_steps=2000)
    assert e.scheduler_stats().get("lookup_timeouts", 0) == 0
    e.assert_empty()


def _wait(condition: Any, timeout: float = 10.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)
