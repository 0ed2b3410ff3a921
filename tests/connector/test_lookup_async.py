"""Asynchronous lookup in vLLM's real Scheduler: the try-again flow, one store call per step, shared probes,
requests that end before their answer, and stores that hang or fall behind.

Scenarios run on :mod:`tests.support.scheduler_harness` (real scheduler, real
worker half, real file store, a fake model whose KV is checked bit for bit).
Store calls are counted by a real pass-through store wrapped around the
scheduler half's store; a hanging store is the link emulator with a round
trip far beyond ``lookup_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.base import Store
from tests.support.scheduler_harness import Engine, loaded_tokens, loads_of, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class CountingStore(Store):
    """Passes every call to the real store, and records each existence check (the keys of each call), and when
    every existence check and batched read started (``calls``: monotonic time, kind)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.checks: list[list[str]] = []
        self.calls: list[tuple[float, str]] = []
        self.gate: threading.Event | None = None  # set: existence checks wait for it (see _hold_checks)
        self.entered = threading.Event()  # an existence check is in the store

    def _exists_many(self, keys: list[str]) -> list[bool]:
        self.calls.append((time.monotonic(), "exists_many"))
        self.checks.append(list(keys))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        return self.inner.exists_many(keys)

    def _exists(self, key: str) -> bool:
        self.checks.append([key])
        return self.inner.exists(key)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        self.calls.append((time.monotonic(), "get_many"))
        return self.inner.get_many(keys)

    def _get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def _put(self, key: str, value: memoryview) -> None:
        self.inner.put(key, value)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _keys(self, prefix: str) -> Iterator[str]:
        return self.inner.keys(prefix)


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
    counting.gate = threading.Event()
    return counting.gate.set


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
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


# ---- lookup auto: answered within the step while the store is fast, on the thread while it is not ----------------
def fast_link(url: str) -> str:
    """A store across an emulated link (so ``auto`` measures it instead of looking up inline) with no latency yet."""
    return f"link+{url}?gbps=10&rtt_ms=0"


def measured(e: Engine) -> Any:
    """The engine's lookup budget once the start-up probe of the store has been taken in."""
    lookups = e.connector.scheduler.lookups
    _wait(lambda: (lookups._drain(), lookups.budget.cost() is not None)[1])
    return lookups.budget


def test_auto_answers_a_fast_store_within_the_asking_step(tmp_path, store) -> None:
    """A network store answering within the step's budget: the request is admitted, and its hit loaded, in the step
    that first asks about it (the lookup thread's answer waited for), not a step later."""
    p = prompt(300)
    stored(tmp_path, store, p, layers_per_object=1)  # objects grouped alike whatever the store (see load_wait)
    e = make(tmp_path, fast_link(store), lookup="auto", lookup_budget_ms=500, layers_per_object=1)
    assert e.connector.scheduler.lookup_mode == "adaptive"
    assert measured(e).inline
    e.add("r", p[:290], max_tokens=3)
    first = e.step()
    assert "r" in first.scheduled and [spec.req_id for spec in first.loads] == ["r"]
    e.run()
    stats = e.scheduler_stats()
    assert loaded_tokens(e, "r") == 288 and stats["lookups_answered_in_step"] == 1
    assert "lookup_retries" not in stats and stats["lookup_steps_inline"] >= 1
    e.assert_empty()


def test_auto_moves_lookups_to_the_thread_while_the_store_is_slow_and_back(tmp_path, store, caplog) -> None:
    """The link's round trip grows past the step's budget: one step waits its budget in vain, then lookups go to
    the thread (the request waits a step, nobody waits for the store); once it is fast again, back within the step.
    Both switches are logged and counted."""
    caplog.set_level(logging.INFO, logger="vllm_kvcodec")
    e = make(tmp_path, fast_link(store), lookup="auto", lookup_budget_ms=100, settle_lookups=False)
    budget = measured(e)
    assert budget.inline
    link = e.connector.scheduler.store.inner
    link._rtt = 0.5  # the emulated link slows to 500 ms a round trip
    e.add("slow", prompt(100, 1), max_tokens=2)
    asked = e.step()
    assert "slow" not in asked.scheduled and e.scheduler_stats()["lookup_wait_s"] >= 0.09  # its budget, in vain
    _wait(lambda: (e.step(), not budget.inline)[1])  # the answer outgrew the budget: on the thread
    e.run(max_steps=2000)
    link._rtt = 0.0
    for i in range(40):  # new lookups on the thread until the cost has fallen under half the budget
        e.add(f"fast{i}", prompt(100, 10 + i), max_tokens=1)
        e.run(max_steps=2000)
        if budget.inline:
            break
    assert budget.inline, budget.cost()
    e.add("back", prompt(100, 99), max_tokens=1)
    assert "back" in e.step().scheduled
    e.run()
    stats = e.scheduler_stats()
    assert stats["lookup_mode_switches_thread"] == 1 and stats["lookup_mode_switches_inline"] == 1
    assert stats["lookup_steps_thread"] >= 1
    messages = list(dict.fromkeys((r.created, r.getMessage()) for r in caplog.records))  # once per record
    assert sum("lookups on the lookup thread" in m for _, m in messages) == 1
    assert sum("lookups answered within the step" in m for _, m in messages) == 2  # first choice, and back
    e.assert_empty()


def test_auto_never_holds_a_step_on_a_store_that_hangs(tmp_path, store) -> None:
    """The store stops answering while lookups are waited for within the step: the step returns after its budget
    (not after the store), the request computes once lookup_timeout_s passed, and nothing is left behind."""
    e = make(tmp_path, fast_link(store), lookup="auto", lookup_budget_ms=100, lookup_timeout_s=0.3,
             settle_lookups=False)
    assert measured(e).inline
    counting = count_checks(e)
    release = _hold_checks(counting)
    e.add("r", prompt(100, 1), max_tokens=2)
    started = time.monotonic()
    asked = e.step()
    assert time.monotonic() - started < 10, "the step waited for the store"  # the store holds it for 30 s
    assert "r" not in asked.scheduled
    e.run(max_steps=2000)
    assert e.scheduler_stats()["lookup_timeouts"] == 1 and not loads_of(e, ["r"])
    release()
    e.assert_empty()


def test_auto_takes_no_answer_time_from_a_store_that_is_down(tmp_path, store, caplog) -> None:
    """A store down from the start refuses every lookup at once (the outage guard): those refusals are no answer
    time, so lookups stay on the thread and no line claims one; once the store answers, they move within the
    step on a time it really took."""
    from storage.testing.faults import find_fault_injector

    caplog.set_level(logging.INFO, logger="vllm_kvcodec")
    e = make(tmp_path, f"faults+{fast_link(store)}&down=1", lookup="auto", lookup_budget_ms=500, store_retry_s=0.2,
             settle_lookups=False)
    budget = e.connector.scheduler.lookups.budget
    for i in range(3):
        e.add(f"down{i}", prompt(100, i), max_tokens=1)
        e.run(max_steps=2000)
    stats = e.scheduler_stats()
    assert stats["lookup_failures"] >= 3 and not budget.inline
    assert not [r for r in caplog.records if "lookups answered within the step" in r.getMessage()]
    find_fault_injector(e.connector.scheduler.store).up()
    for i in range(40):  # lookups on the thread until the store, tried again after store_retry_s, answers one
        time.sleep(0.05)
        e.add(f"up{i}", prompt(100, 10 + i), max_tokens=1)
        e.run(max_steps=2000)
        if budget.inline:
            break
    assert budget.inline and budget.cost() is not None
    messages = dict.fromkeys((r.created, r.getMessage()) for r in caplog.records)  # once per record
    said = [m for _, m in messages if "lookups answered within the step" in m]
    assert len(said) == 1, said
    e.assert_empty()


# ---- lookups nobody waits for are not sent ------------------------------------------------------------------------
def test_a_stalled_store_runs_no_probe_after_its_deadline(tmp_path, store) -> None:
    """The store stalls on the first batch while two more steps' batches queue behind it; every deadline passes
    (the requests compute), then the store answers: the thread sends nothing more (not the first batch's block-ref
    read, not the queued batches), and counts the three questions it skipped."""
    e = make(tmp_path, store, lookup_timeout_s=0.3, settle_lookups=False)
    counting = count_checks(e)
    release = _hold_checks(counting)
    for i in range(3):
        e.add(f"r{i}", prompt(100, i), max_tokens=2)
        e.step()
        if i == 0:
            assert counting.entered.wait(10)  # the thread is in the store with the first batch
    time.sleep(0.35)
    e.run(max_steps=2000)  # every request given up on (a miss) and computed
    released = time.monotonic()
    release()
    assert e.connector.scheduler.lookups.wait_idle(10)
    assert [kind for t, kind in counting.calls if t >= released] == [], "a store call after its deadline"
    assert len(counting.checks) == 1
    stats = e.scheduler_stats()
    assert stats["lookup_timeouts"] == 3 and stats["lookups_skipped_late"] == 3
    e.assert_empty()


def test_a_question_whose_requests_all_ended_is_not_sent(tmp_path, store) -> None:
    """A request aborted while its batch waits behind a slow one: its question never reaches the store (counted);
    the other request's lookup completes."""
    e = make(tmp_path, store, settle_lookups=False)
    counting = count_checks(e)
    release = _hold_checks(counting)
    e.add("kept", prompt(100, 1), max_tokens=2)
    e.step()
    assert counting.entered.wait(10)
    e.add("gone", prompt(100, 2), max_tokens=2)
    e.step()  # its batch queues behind the held one
    e.abort("gone")
    release()
    assert e.connector.scheduler.lookups.wait_idle(10)
    assert len(counting.checks) == 1 and e.scheduler_stats()["lookups_skipped_unwanted"] == 1
    e.run()
    e.assert_empty()
