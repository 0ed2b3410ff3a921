"""load_wait: auto's judge of whether recent loads were bound by their fetches or by their decode."""

from __future__ import annotations

from vllm_kvcodec.load.load_balance import LoadBalance


def test_no_verdict_before_the_first_load_and_none_from_empty_loads() -> None:
    balance = LoadBalance()
    assert balance.cpu_bound is None
    balance.observe(0.0, 1, 0.5, 1)  # nothing fetched (every object failed, say): no evidence
    balance.observe(0.5, 1, 0.0, 1)
    assert balance.cpu_bound is None


def test_per_thread_seconds_decide() -> None:
    # 1 Gbit/s rans: 4 batches of 42 ms on one fetch thread, 16 ms of decode each on two decode threads.
    slow_link = LoadBalance()
    slow_link.observe(4 * 0.042, 1, 4 * 0.016, 2)
    assert slow_link.cpu_bound is False
    # 100 Gbit/s: the same decode against 0.5 ms fetches.
    fast_link = LoadBalance()
    fast_link.observe(4 * 0.0005, 1, 4 * 0.016, 2)
    assert fast_link.cpu_bound is True
    # The same thread-seconds spread over twice the decode threads halve the decode's share.
    even = LoadBalance()
    even.observe(0.1, 1, 0.15, 2)
    assert even.cpu_bound is False


def test_one_odd_load_does_not_flip_a_settled_verdict() -> None:
    balance = LoadBalance()
    for _ in range(5):
        balance.observe(0.2, 1, 0.05, 1)  # wire-bound, 4x
    balance.observe(0.01, 1, 0.05, 1)  # one load from a warm cache: 5x the other way
    assert balance.cpu_bound is False
    for _ in range(4):
        balance.observe(0.01, 1, 0.05, 1)
    assert balance.cpu_bound is True
