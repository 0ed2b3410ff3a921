"""Where a hit ends, on a real engine in bf16: the same tokens as vLLM's own prefix cache, wherever sharing stops.

Issue #32's case: a prompt that shares part of a stored one must be served
exactly the blocks vLLM's local prefix cache would serve (bf16 prefill of a
suffix over a shorter hit rounds differently, and a near-tie flips a greedy
token). Each prompt below shares a stored 1400-token prompt up to a
different position class: a chunk boundary, a block inside a full stored
chunk, inside a block, a block inside the stored prompt's tail, and the whole
prompt. The connector's engine (its own cache emptied before each) must load
as many tokens as vLLM's own cache hits in an engine without the connector,
and produce the same greedy tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.engine import BLOCK, greedy
from tests.support.engine_pool import connected, plain
from vllm_kvcodec.tools.offline_engine import take_finishing_step

pytestmark = pytest.mark.engine

CHUNK = 4 * BLOCK  # 512: refs name blocks inside chunks
STORED = 1400
SHARED = {"chunk boundary": 1024, "block inside a full chunk": 640, "inside a block": 700,
          "block inside the stored tail": 1152, "the whole prompt": STORED}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    text = sample_token_ids(2000)
    stored = text[:STORED]
    other = [t for t in text[STORED:] if t not in stored[-1:]]  # tokens that differ right after the shared part
    return {"stored": stored, **{name: stored[:n] + (other[: 1500 - n] if n < STORED else []) for name, n in SHARED.items()}}


def local_hit(n_shared: int, n_tokens: int) -> int:
    return min(n_shared // BLOCK, (n_tokens - 1) // BLOCK) * BLOCK


#: The connector's engine of both tests (shared: tests/support/engine_pool.py).
CONNECTED = connected(codec="rans", chunk_size=CHUNK)
#: A chat's first turn, ending inside a chunk, answered at length.
TURN1_TOKENS, ANSWER_TOKENS = 700, 100


@pytest.fixture(scope="module")
def local(prompts, engines) -> dict[str, Any]:
    """vLLM's own prefix cache, no connector: greedy tokens and cached tokens of each prompt in an engine whose cache
    computed the stored one; and of a chat's second turn after its first ("chat")."""
    from vllm import SamplingParams

    out: dict[str, Any] = {}
    e = engines.get(plain())
    greedy(e.llm, prompts["stored"])
    for name in SHARED:
        (res,) = e.llm.generate([{"prompt_token_ids": prompts[name]}], SamplingParams(max_tokens=12, temperature=0),
                                use_tqdm=False)
        out[name] = (list(res.outputs[0].token_ids), res.num_cached_tokens)
    e.reset()
    turn1 = prompts["stored"][:TURN1_TOKENS]
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    answer = list(e.llm.generate([{"prompt_token_ids": turn1}], params, use_tqdm=False)[0].outputs[0].token_ids)
    turn2 = turn1 + answer + prompts["stored"][900:1000]
    (res,) = e.llm.generate([{"prompt_token_ids": turn2}], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    out["chat"] = {"turn1": turn1, "answer": answer, "turn2": turn2, "tokens": list(res.outputs[0].token_ids),
                   "cached": res.num_cached_tokens}
    return out


def test_a_hit_ends_where_the_local_prefix_cache_ends_with_the_same_tokens(prompts, local, engines) -> None:
    e = engines.get(CONNECTED)
    llm, conn = e.llm, e.conn
    greedy(llm, prompts["stored"])
    take_finishing_step(llm)  # the finishing tail (1411 computed: 384 past the chunks) is gathered in that step
    assert conn.flush(120)
    stats = e.counters()
    # 2 full chunks (3 refs each), the 256-token prompt tail (2 refs, one its own), the finishing tail (3)
    assert stats["saved_chunks"] == 4 and stats["saved_refs"] == 2 * 3 + 2 + 3, stats
    for name, n in SHARED.items():
        tokens, cached = local[name]
        assert cached == local_hit(n, len(prompts[name])), name  # vLLM's own cache, block-granular
        take_finishing_step(llm)
        assert llm.reset_prefix_cache()  # whatever is hit below comes from the store
        before = conn.stats().get("loaded_tokens", 0)
        assert greedy(llm, prompts[name]) == tokens, name
        assert conn.stats().get("loaded_tokens", 0) - before == cached, name
    assert e.counters().get("load_failures", 0) == 0


def test_a_chats_next_turn_loads_every_block_the_last_turn_computed(local, engines) -> None:
    """Turn 1 ends inside a chunk; its finishing tail (prompt and answer past the last full chunk) is stored, so
    turn 2 on an emptied cache loads what vLLM's own cache would hit, and gives the local-cache run's tokens."""
    from vllm import SamplingParams

    chat = local["chat"]
    turn1, answer = chat["turn1"], chat["answer"]
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    # 799 computed: 768 in whole blocks (the prompt's tail ends at 640)
    assert chat["cached"] == (len(turn1) + len(answer) - 1) // BLOCK * BLOCK
    e = engines.get(CONNECTED)
    llm, conn = e.llm, e.conn
    assert list(llm.generate([{"prompt_token_ids": turn1}], params, use_tqdm=False)[0].outputs[0].token_ids) == answer
    take_finishing_step(llm)  # the turn's finishing tail is gathered in the step after it finished
    assert conn.flush(120) and e.counters()["saved_chunks"] == 3  # chunk 0, the prompt's tail, the finishing tail
    assert llm.reset_prefix_cache()
    before = conn.stats().get("loaded_tokens", 0)
    assert greedy(llm, chat["turn2"]) == chat["tokens"]
    assert conn.stats().get("loaded_tokens", 0) - before == chat["cached"]
    assert e.counters().get("load_failures", 0) == 0
