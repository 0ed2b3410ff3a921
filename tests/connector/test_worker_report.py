"""What the tensor-parallel workers' reports add up to, as vLLM's output aggregator combines them."""

from __future__ import annotations

from vllm_kvcodec.connector.metadata import KVCodecWorkerReport
from vllm_kvcodec.outcomes import LoadOutcome, SaveOutcome


def test_ranks_reports_combine_to_the_worst_case() -> None:
    rank0 = KVCodecWorkerReport({"a": LoadOutcome(["h0", "h1"], [])}, [SaveOutcome("a", "s", True)], save_room=1 << 20)
    rank1 = KVCodecWorkerReport({"a": LoadOutcome(["h0"], ["h1"])}, [SaveOutcome("a", "s", False, needs_room=4096)],
                                save_room=2048)
    both = rank0.aggregate(rank1)
    assert both.loads["a"] == LoadOutcome(["h0"], ["h1"])  # failed on any rank: failed
    assert [s.landed for s in both.saves] == [True, False]  # each rank's save outcome reaches the scheduler
    assert both.save_room == 2048  # a retry must fit in the fullest rank's queue


def test_room_of_a_rank_without_a_saver_is_not_a_limit() -> None:
    assert KVCodecWorkerReport(save_room=None).aggregate(KVCodecWorkerReport(save_room=300)).save_room == 300
    assert KVCodecWorkerReport().aggregate(KVCodecWorkerReport()).save_room is None
    assert not KVCodecWorkerReport(save_room=300)  # room alone is no reason to send a report
