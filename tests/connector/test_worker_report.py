"""What the tensor-parallel workers' reports add up to, as vLLM's output aggregator combines them, and when the
scheduler half's ledger takes a load as settled (every worker reported it, in one step or several)."""

from __future__ import annotations

import time

from vllm_kvcodec.connector.load_ledger import LoadLedger
from vllm_kvcodec.connector.metadata import KVCodecWorkerReport
from vllm_kvcodec.plans.outcomes import LoadOutcome, SaveOutcome


def test_ranks_reports_combine_to_the_worst_case() -> None:
    rank0 = KVCodecWorkerReport({"a": LoadOutcome(["h0", "h1"], [])}, [SaveOutcome("a", "s", True)], save_room=1 << 20)
    rank1 = KVCodecWorkerReport({"a": LoadOutcome(["h0"], ["h1"])}, [SaveOutcome("a", "s", False, needs_room=4096)],
                                save_room=2048)
    both = rank0.aggregate(rank1)
    assert both.loads["a"] == LoadOutcome(["h0"], ["h1"], ranks=2)  # failed on any rank: failed; two ranks' word
    assert [s.landed for s in both.saves] == [True, False]  # each rank's save outcome reaches the scheduler
    assert both.save_room == 2048  # a retry must fit in the fullest rank's queue


def test_room_of_a_rank_without_a_saver_is_not_a_limit() -> None:
    assert KVCodecWorkerReport(save_room=None).aggregate(KVCodecWorkerReport(save_room=300)).save_room == 300
    assert KVCodecWorkerReport().aggregate(KVCodecWorkerReport()).save_room is None
    assert not KVCodecWorkerReport(save_room=300)  # room alone is no reason to send a report


def test_ranks_that_read_an_adapters_files_apart_report_its_weights_unknown() -> None:
    """Each rank loads a LoRA adapter on its own; one that read other files (a rewrite between their reads) runs
    other weights than the others, so the adapter's id is reported as unknown, and its requests are not cached."""
    rank0 = KVCodecWorkerReport(adapters={1: "w1", 2: "w2"})
    rank1 = KVCodecWorkerReport(adapters={1: "w1", 2: "w2-rewritten", 3: "w3"})
    assert rank0.aggregate(rank1).adapters == {1: "w1", 2: "", 3: "w3"}
    assert rank0  # a load alone is reason to send a report: the scheduler keys the adapter's requests by it


def test_a_load_settles_once_every_worker_reported_whatever_the_steps() -> None:
    """TP=2 x PP=2: four workers run each load; two report in one step (merged by vLLM), the others later."""
    ledger = LoadLedger(inflight_ttl_s=60, loaders=4)
    load = ledger.start("r", ["h0", "h1"], {"h0": 0, "h1": 32}, [[1, 2, 3, 4]], [{1, 2, 3, 4}])
    assert ledger.report(LoadOutcome(["h0", "h1"], [], load, ranks=2)) is None
    assert ledger.busy(["h1"]) and ledger.writes_any([[3]]), "still written by the workers that did not report"
    assert ledger.report(LoadOutcome(["h0"], ["h1"], load)) is None
    settled = ledger.report(LoadOutcome(["h0", "h1"], [], load))
    assert settled is not None and settled.load is not None and settled.load.req_id == "r"
    assert settled.outcome == LoadOutcome(["h0"], ["h1"], load, ranks=4), "a failure on one worker fails the load"
    assert ledger.is_idle() and ledger.report(LoadOutcome([], ["h1"], load)).load is None  # settled once


def test_an_expired_load_still_counts_its_reports() -> None:
    """A load past its TTL stops holding other requests back, but its workers' reports still settle it once."""
    ledger = LoadLedger(inflight_ttl_s=0.0, loaders=2)
    load = ledger.start("r", ["h0"], {"h0": 0}, [[1]], [{1}])
    time.sleep(0.001)
    assert not ledger.busy(["h0"]) and ledger.is_idle()
    assert ledger.report(LoadOutcome(["h0"], [], load)) is None
    settled = ledger.report(LoadOutcome([], ["h0"], load))
    assert settled is not None and settled.load is not None and settled.outcome.failed == ["h0"]
