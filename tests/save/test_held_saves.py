"""Saves held for every worker's outcome of a load: stored on a clean verdict, dropped on a failure or a lost one.

The scheduler-level scenarios (tests/connector/test_scheduler_tp.py) drive the
verdicts through vLLM's real Scheduler; these pin the Saver's side on a real
memory store, including what no scenario reaches: a verdict that never comes
(its hold expires) and holds left at shutdown.
"""

from __future__ import annotations

import torch

from storage.memory_store import MemoryStore
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.format import decode_chunk
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.plans.outcomes import SaveOutcome
from vllm_kvcodec.save.held_saves import HeldSaves
from vllm_kvcodec.save.saver import Saver
from vllm_kvcodec.stats import ConnectorStats

NAMESPACE = Namespace(model_id="held-test", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=32,
                      layout_id="canonical", tp_size=2, chunk_size=16, layers_per_object=2)
ADDRESSES = ObjectAddresses(NAMESPACE, 0, (range(2),))
KV = torch.randn(2, 2, 16, 2, 32).to(torch.bfloat16)
NBYTES = KV.numel() * KV.element_size()


def saver(ttl_s: float = 60.0) -> tuple[Saver, MemoryStore, list[SaveOutcome]]:
    store, outcomes = MemoryStore(), []
    s = Saver(store, ADDRESSES, CodecChooser("raw"), 1, 1 << 20, ConnectorStats(), report=outcomes.append,
              held=HeldSaves(ttl_s))
    return s, store, outcomes


def stored(store: MemoryStore, chunk: str) -> bool:
    return store.get(ADDRESSES.key(chunk, 0)) is not None


def test_a_hold_is_stored_once_every_load_it_names_settled_clean() -> None:
    s, store, outcomes = saver()
    assert s.reserve(NBYTES) and s.submit("a" * 32, KV, "r", reserved=True, hold=[7, 8])
    s.settle_loads({7: False})
    assert s.flush(10) and not stored(store, "a" * 32) and s.room() == (1 << 20) - NBYTES, "held, its bytes counted"
    s.settle_loads({8: False})
    assert s.flush(10) and torch.equal(decode_chunk(store.get(ADDRESSES.key("a" * 32, 0))).view(torch.int16),
                                       KV.view(torch.int16))
    assert outcomes == [SaveOutcome("r", "a" * 32, landed=True)] and s.room() == 1 << 20 and not s.held
    s.shutdown()


def test_a_failure_of_any_load_drops_it_unwritten_and_says_why() -> None:
    s, store, outcomes = saver()
    s.settle_loads({3: True})  # a verdict that arrives before its hold is remembered
    assert s.submit("b" * 32, KV, "r", hold=[3])
    assert s.submit("c" * 32, KV, "r", hold=[4, 5])
    s.settle_loads({4: False, 5: True})
    assert s.flush(10) and not stored(store, "b" * 32) and not stored(store, "c" * 32)
    assert outcomes == [SaveOutcome("r", h * 32, landed=False, load_failed=True) for h in "bc"]
    assert s.stats.totals()["saves_dropped_after_load_failure_elsewhere"] == 2 and s.room() == 1 << 20
    s.shutdown()


def test_a_verdict_that_never_comes_and_holds_left_at_shutdown_are_dropped_as_unsettled() -> None:
    s, store, outcomes = saver(ttl_s=0.0)
    assert s.submit("d" * 32, KV, "r", hold=[9])
    s.settle_loads({})  # the next step's plan: no verdict, and the hold is past its TTL
    s2, store2, outcomes2 = saver()
    assert s2.submit("e" * 32, KV, "r", hold=[9])
    s2.shutdown()
    for st, out, h in ((store, outcomes, "d"), (store2, outcomes2, "e")):
        assert not stored(st, h * 32)
        assert out == [SaveOutcome("r", h * 32, landed=False)], "not load_failed: the scheduler half plans it again"
    assert s.stats.totals()["saves_dropped_load_unsettled"] == 1 and s2.stats.totals()["saves_dropped_load_unsettled"] == 1
    s.shutdown()


def test_without_other_workers_nothing_is_held() -> None:
    store = MemoryStore()
    s = Saver(store, ADDRESSES, CodecChooser("raw"), 1, 1 << 20, ConnectorStats())
    assert s.submit("f" * 32, KV, "r", hold=[1]) and s.flush(10) and stored(store, "f" * 32)
    s.shutdown()
