"""A lossless read takes no lossy object, even one bound to the key it asked for.

The namespaces keep lossy objects under keys of their own; this is the
fetcher's own check behind them, so a store written wrongly (a tool, a
migration, another build) cannot hand a lossless engine quantised KV.
"""

from __future__ import annotations

import pytest
import torch

from storage import open_store
from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.paged import layout_for
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.stats import ConnectorStats

CHUNK_HASH = "1" * 32


def _load(precision: str) -> tuple[list[torch.Tensor], torch.Tensor, dict, set]:
    """An int8 object of one 16-token chunk stored under the engine's own key, read as ``precision``."""
    caches = [torch.zeros((4, 2, 16, 64), dtype=torch.bfloat16) for _ in range(2)]
    layout = layout_for("CPU_ATTN", caches[0], block_size=16, head_size=32, num_kv_heads=2)
    ns = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, layout_id="canonical-v1",
                   tp_size=1, chunk_size=16, layers_per_object=2)
    addresses = ObjectAddresses(ns, 0, tuple(ns.layer_groups()))
    key = addresses.key(CHUNK_HASH, 0)
    kv = torch.randn((2, 2, 16, 2, 32), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    blob = encode_chunk(kv, precision="int8", key=key)
    store = open_store("memory://")
    store.put(key, blob)
    stats = ConnectorStats()
    variants = {} if precision == LOSSLESS else {precision: addresses}
    fetcher = Fetcher(store, addresses, caches, [layout] * 2, 1, stats, variants=variants)
    try:
        chunk = ChunkLoad(CHUNK_HASH, [Span(0, list(range(16)))], [0], precisions=(precision,))
        job = fetcher.submit([LoadSpec("r", [chunk], False)], timeout_s=30)
        assert job.wait_all(job.deadline)
    finally:
        fetcher.shutdown()
    return caches, decode_chunk(blob), stats.totals(), set(job.failed_blocks)


def test_a_lossless_read_of_a_lossy_object_is_a_failed_load() -> None:
    caches, _, totals, failed = _load(LOSSLESS)
    assert failed == {0} and totals["load_failures_mismatch"] == 1
    assert not any(c.any() for c in caches)  # nothing written


@pytest.mark.parametrize("level", ["int8"])
def test_the_same_object_read_as_its_level_lands(level: str) -> None:
    caches, want, totals, failed = _load(level)
    assert not failed and totals[f"precision_reads_{level}"] == 1
    layout = layout_for("CPU_ATTN", caches[0], block_size=16, head_size=32, num_kv_heads=2)
    for layer, cache in enumerate(caches):
        got = layout.gather(cache, torch.arange(16))
        assert torch.equal(got.view(torch.int16), want[layer].view(torch.int16))
