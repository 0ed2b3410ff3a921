"""Chunks larger than a block: partial local hits, chunked prefill saves, keys across engines.

float32, so tokens must equal a full recompute whatever mix of local hits,
loads and computation served the prefix.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import connector_config, engine, greedy, worker_connector
from tests.support.engine_pool import connected, plain

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


@pytest.fixture(scope="module")
def recompute(text, engines) -> dict[str, list[int]]:
    llm = engines.get(plain("float32", prefix_caching=False)).llm
    return {"600": greedy(llm, text[:600]), "1300": greedy(llm, text[:1300]), "1400": greedy(llm, text[:1400])}


def test_chunk_of_two_blocks_with_a_partial_local_hit(text, recompute, engines) -> None:
    e = engines.get(connected(codec="rans", chunk_size=256, dtype="float32"))
    llm, conn, url = e.llm, e.conn, e.url
    # Longer than max_num_batched_tokens (512): its 5 chunks complete over 3 steps.
    assert greedy(llm, text[:1300]) == recompute["1300"]
    assert conn.flush(120) and e.counters()["saved_chunks"] == 5
    llm.reset_prefix_cache()
    greedy(llm, text[:129], max_tokens=1)  # vLLM now holds block 0 locally; no full chunk to load
    before = conn.stats().get("loaded_tokens", 0)
    assert greedy(llm, text[:600]) == recompute["600"]
    spec = conn.worker.recent_loads[-1]
    assert spec.chunks[0].first_token == 128, "the locally cached block must not be loaded again"
    assert conn.stats()["loaded_tokens"] - before == 512 - 128
    # A fresh engine (new process state, same store) finds the chunks under the same keys: its own engine.
    assert conn.flush(120)
    with engine(connector_config(url, "rans", chunk_size=256), dtype="float32") as llm:
        conn = worker_connector()
        assert greedy(llm, text[:1400]) == recompute["1400"]
        assert conn.stats()["loaded_tokens"] == 1280
        slots = torch.tensor(conn.worker.recent_loads[-1].chunks[-1].slots)
        assert slots.numel() == 256


def test_burst_sharing_a_new_prefix_saves_it_once(text, engines) -> None:
    from vllm import SamplingParams

    e = engines.get(connected(codec="splitzip", chunk_size=256, dtype="float32"))
    burst = [{"prompt_token_ids": text[:600] + [11 + i] * 20} for i in range(3)]
    e.llm.generate(burst, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert e.conn.flush(120)
    assert e.counters()["saved_chunks"] == 2  # chunks 0 and 1 of the shared 600 tokens, once


def test_save_cap_applies_before_gathering(text, recompute, engines) -> None:
    """A chunk that does not fit under max_pending_save_bytes is never copied out of paged memory.

    It is planned again once a worker report shows room for it (the request
    still holds its blocks; 36 decode steps give the puts time): all four land.
    """
    cap = 12 << 20  # two 128-token float32 chunks (5.9 MB each) fit, a third does not
    e = engines.get(connected(codec="raw", chunk_size=128, save_threads=1, max_pending_save_bytes=cap, dtype="float32"))
    assert greedy(e.llm, text[:600], max_tokens=36)[:12] == recompute["600"]  # one 512-token step: 4 chunks
    assert e.conn.flush(120)
    stats = e.counters()
    assert stats["saves_dropped"] >= 2 and stats["saved_chunks"] == 4, stats
    assert stats["saved_raw_bytes"] == 4 * 128 * 30 * 2 * 3 * 64 * 4, stats  # each chunk once


def test_a_replayed_prompt_loads_its_tail_as_the_local_cache_serves_it(text, engines) -> None:
    """prompt_tails: a replay loads every block but the last token's, as vLLM's own prefix cache would serve it,
    so it computes the same tokens over the same KV (bf16: bit-identical greedy tokens to the local hit)."""
    from tests.support.engine import BLOCK, assert_paged_kv_equals_stored

    ids = text[:1300]
    llm = engines.get(plain()).llm
    greedy(llm, ids)
    local_hit = greedy(llm, ids)
    e = engines.get(connected(codec="rans", chunk_size=4 * BLOCK, prompt_tails=True))
    greedy(e.llm, ids)
    assert e.conn.flush(120) and e.counters()["saved_chunks"] == 3  # two full chunks and the tail
    e.llm.reset_prefix_cache()
    assert greedy(e.llm, ids) == local_hit
    assert e.counters()["loaded_tokens"] == (len(ids) - 1) // BLOCK * BLOCK
    assert e.conn.worker.recent_loads[-1].chunks[-1].object_tokens == 2 * BLOCK
    assert_paged_kv_equals_stored(e.conn, e.url)
