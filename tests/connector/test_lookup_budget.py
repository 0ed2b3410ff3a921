"""``lookup: auto``'s choice (vllm_kvcodec/connector/lookup_budget.py), on a clock the test moves.

The scheduler-level behaviour (a request admitted in its first step, a store
that hangs, switching both ways on a real link emulator) is in
test_lookup_async.py; here, the arithmetic those rest on: the step's budget
follows the engine's step time, idle steps do not count, and the choice
switches with hysteresis on what the store took.
"""

from __future__ import annotations

import pytest

from vllm_kvcodec.connector import lookup_budget
from vllm_kvcodec.connector.lookup_budget import LookupBudget
from vllm_kvcodec.stats import ConnectorStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(lookup_budget.time, "monotonic", c)
    return c


def steps(budget: LookupBudget, clock: Clock, seconds: float, n: int, ran: bool = True) -> None:
    for _ in range(n):
        clock.now += seconds
        budget.step_ended(ran=ran, asked=False)


def test_the_budget_is_a_share_of_the_engine_step_time_or_the_floor(clock: Clock) -> None:
    budget = LookupBudget(ConnectorStats(), floor_s=0.001, share=0.05)
    assert budget.budget_s == 0.001  # no step seen yet
    steps(budget, clock, 0.010, 5)  # 10 ms steps (a GPU decoding): 5% is under the floor
    assert budget.budget_s == pytest.approx(0.001)
    steps(budget, clock, 1.0, 16)  # 1 s steps (a CPU prefill): 5% of them
    assert budget.budget_s == pytest.approx(0.05)
    # The engine pauses 30 s after its last step (no requests) and then steps idle: the pause counts once, as a
    # step, and the median of the last 16 shrugs it off; the idle steps after it count not at all.
    steps(budget, clock, 30.0, 3, ran=False)
    assert [round(s, 6) for s in budget._steps].count(30.0) == 1 and budget.budget_s == pytest.approx(0.05)


def test_inline_while_a_lookup_fits_the_budget_back_only_under_half_of_it(clock: Clock) -> None:
    stats = ConnectorStats()
    budget = LookupBudget(stats, floor_s=0.010, share=0.0)
    assert not budget.inline and budget.wait_left() == 0  # nothing known: nobody waits
    for _ in range(3):
        budget.observe(0.002)  # the start-up probe: 2 ms a lookup
    assert budget.inline and budget.wait_left() == pytest.approx(0.010)
    budget.waited(0.004)
    assert budget.wait_left() == pytest.approx(0.006)
    budget.observe(0.030)  # one batch took 30 ms: over the budget
    assert not budget.inline and budget.wait_left() == 0
    budget.observe(0.008)  # under the budget, but over half of it: stays on the thread
    assert not budget.inline
    budget.observe(0.002)
    assert budget.inline
    totals = stats.totals()
    assert totals["lookup_mode_switches_thread"] == 1 and totals["lookup_mode_switches_inline"] == 1
    assert totals["lookup_wait_s"] == pytest.approx(0.004)


def test_a_batch_the_store_is_still_answering_counts_as_long_as_it_took_so_far(clock: Clock) -> None:
    budget = LookupBudget(ConnectorStats(), floor_s=0.010, share=0.0)
    budget.observe(0.001)
    assert budget.inline
    budget.answering(clock.now)  # the lookup thread sends a batch; the store hangs
    clock.now += 0.005
    budget.step_ended(ran=True, asked=True)
    assert budget.inline  # 5 ms so far: within the budget
    clock.now += 0.020
    budget.step_ended(ran=True, asked=True)
    assert not budget.inline and budget.cost() == pytest.approx(0.025)
