"""What ``precision: auto`` reads, chunk by chunk: the lossless objects while they arrive within the budget, else the
variant of the load's last chunks, chosen from measured reads (save/precision_choice.py)."""

from __future__ import annotations

import pytest

from vllm_kvcodec.save.link_estimate import LinkEstimate
from vllm_kvcodec.save.precision_choice import ReadCosts, merge_costs, variant_from

MB = 1 << 20


def costs_on(link_bytes_per_s: float) -> ReadCosts:
    """A worker's costs on a link of that speed, with lossless objects at 1.5x and int8 ones at 2x, as measured."""
    link = LinkEstimate(link_bytes_per_s)
    costs = ReadCosts(link, ["lossless", "int8"], source_bits=16, decoders=2)
    for _ in range(200):  # the running figures settle on what the objects hold
        costs.observe("lossless", 2 * MB, 3 * MB)
        costs.observe("int8", 3 * MB // 2, 3 * MB)
    return costs


def test_a_slow_link_reads_the_last_chunks_as_the_variant_a_fast_one_reads_lossless() -> None:
    chunks = [6 * MB] * 4  # raw bytes of a 4-chunk load
    slow = costs_on(100e6).costs()  # 100 MB/s: 16 MB lossless in 0.16 s, 12 MB as int8 in 0.12 s
    assert slow["lossless"] == pytest.approx(1 / (1.5 * 100e6), rel=0.01)
    assert slow["int8"] == pytest.approx(1 / (2.0 * 100e6), rel=0.01)
    assert variant_from(chunks, slow, "int8", budget_s=1.0) == 4  # fits: all lossless
    assert variant_from(chunks, slow, "int8", budget_s=0.15) == 2  # the last two as the variant
    assert variant_from(chunks, slow, "int8", budget_s=0.01) == 0  # never fits: the fastest there is
    fast = costs_on(10e9).costs()
    assert variant_from(chunks, fast, "int8", budget_s=0.01) == 4


def test_nothing_measured_or_a_variant_that_is_no_faster_keeps_every_chunk_lossless() -> None:
    chunks = [6 * MB] * 3
    assert variant_from(chunks, {}, "int8", budget_s=1e-6) == 3
    assert variant_from(chunks, {"lossless": 1e-9, "int8": 2e-9}, "int8", budget_s=1e-6) == 3  # its decode outweighs


def test_decode_time_counts_and_changes_are_reported_once() -> None:
    costs = costs_on(100e6)
    first = costs.report()
    assert first is not None and costs.report() is None  # unchanged: nothing to tell
    for _ in range(50):
        costs.observe("int8", 3 * MB // 2, 3 * MB, decode_s=0.1)  # 30 MB/s of decode on 2 threads: slower than the link
    assert costs.report()["int8"] > first["int8"]
    assert merge_costs({"lossless": 1.0, "int8": 3.0}, {"lossless": 2.0, "int8": 1.0}) == {"lossless": 2.0, "int8": 3.0}
