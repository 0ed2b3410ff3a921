"""A load abandoned at its deadline keeps reading in the background; ``settle`` and ``flush`` wait for that read.

Counters read before it lack the abandoned batch (a faults test once saw one
more store read than fetch batches), so anything that reads them after serving
waits for the fetcher to be idle first.
"""

from __future__ import annotations

import torch

from storage import open_store
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.paged import layout_for
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.stats import ConnectorStats

RTT_S = 1.0  # far longer than the load's deadline and than any pause between submit and the first check


def test_settle_waits_for_the_read_of_a_load_abandoned_at_its_deadline() -> None:
    caches = [torch.zeros((4, 2, 16, 64), dtype=torch.bfloat16) for _ in range(2)]
    layout = layout_for("CPU_ATTN", caches[0], block_size=16, head_size=32, num_kv_heads=2)
    ns = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, layout_id="canonical-v1",
                   tp_size=1, chunk_size=16, layers_per_object=2)
    stats = ConnectorStats()
    store = open_store(f"link+memory://?gbps=10&rtt_ms={RTT_S * 1000:g}")
    fetcher = Fetcher(store, ObjectAddresses(ns, 0, tuple(ns.layer_groups())), caches, [layout] * 2, 1, stats)
    try:
        job = fetcher.submit([LoadSpec("r", [ChunkLoad("0" * 32, [Span(0, list(range(16)))], [1])], False)],
                             timeout_s=0.05)
        assert not job.wait_all(job.deadline)  # what the worker does: at its deadline the load is given up
        assert not fetcher.settle(0)  # the read is still in the air
        assert "fetch_batches" not in stats.totals()
        assert fetcher.settle(10 * RTT_S)
        assert stats.totals()["fetch_batches"] == 1  # the abandoned batch is counted once it settled
        assert fetcher.settle(0)
    finally:
        fetcher.shutdown()


def test_batches_cancelled_by_shutdown_leave_nothing_to_wait_for() -> None:
    caches = [torch.zeros((4, 2, 16, 64), dtype=torch.bfloat16) for _ in range(2)]
    layout = layout_for("CPU_ATTN", caches[0], block_size=16, head_size=32, num_kv_heads=2)
    ns = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, layout_id="canonical-v1",
                   tp_size=1, chunk_size=16, layers_per_object=1)  # two groups: two batches, one fetch thread
    stats = ConnectorStats()
    store = open_store(f"link+memory://?gbps=10&rtt_ms={RTT_S * 1000:g}")
    fetcher = Fetcher(store, ObjectAddresses(ns, 0, tuple(ns.layer_groups())), caches, [layout] * 2, 1, stats)
    fetcher.submit([LoadSpec("r", [ChunkLoad("0" * 32, [Span(0, list(range(16)))], [1])], False)], timeout_s=0.05)
    fetcher.shutdown()  # a batch already reading finishes (1 s); at least the second, still queued, is cancelled
    assert stats.totals().get("fetch_batches", 0) <= 1
    assert fetcher.settle(0)
