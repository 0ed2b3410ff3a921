"""What the engine tests of tensor and pipeline parallelism share: one engine, a worker process per rank or stage.

The engine computes and saves the prompts and gives the references (a cold
run, and a rerun served by vLLM's local prefix cache with as many cached
tokens as a connector load); then, reset as a fresh engine on its store would
start (:func:`as_fresh`), it loads them. (That a new engine process finds the
same keys is tests/connector/test_connector_chunks.py's; starting a parallel
engine costs a minute or two on 2 cores.) What a worker holds is read in its
own process through ``LLM.collective_rpc(worker_state)``, in the order of
vLLM's global ranks (stage-major: stage 0's TP ranks first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from tests.support.engine import assert_paged_kv_equals_stored


def prompts(text: list[int]) -> dict[str, list[int]]:
    """P loads 4 chunks of 128; M 2 (its second chunk will lack one worker's object); F 3 (one worker's first
    object corrupted); M_HEAD is M's first chunk only (and a partial one)."""
    return {"p": text[:600], "m_head": text[600:800], "m": text[600:900], "f": text[900:1300]}


@contextlib.contextmanager
def one_omp_thread() -> Iterator[None]:
    """Worker processes started inside inherit it: each worker's OpenMP team is one thread, so several workers on a
    small host do not fight over its cores (without it they slow down many times)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def generate(llm: Any, token_ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=12, temperature=0),
                       use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}


def as_fresh(llm: Any) -> Any:
    """The engine as a fresh one on its store would start: every worker's saves flushed, the steps owed to finished
    requests taken, vLLM's prefix cache and the connector's memory of the store emptied."""
    from tests.support.engine_pool import reset_engine

    llm.collective_rpc(worker_state)  # flushes every worker's saves
    reset_engine(llm, connector=True)
    return llm


def references(llm: Any, text: list[int], chunk: int) -> dict[str, Any]:
    """The saving engine: every prompt computed cold (and saved by each worker), then P again from the local prefix cache,
    and M after its first chunk alone: the references for a 4-chunk and a 1-chunk hit; ``workers`` their states."""
    p = prompts(text)
    out = {"cold_p": generate(llm, p["p"]), "m_head": generate(llm, p["m_head"])}
    llm.collective_rpc(worker_state)  # M's first chunk is stored before M is looked up: saved once
    out.update(local_m=generate(llm, p["m"]), cold_f=generate(llm, p["f"]), local_p=generate(llm, p["p"]))
    out["workers"] = llm.collective_rpc(worker_state)  # flushes every worker's saves first
    assert out["cold_p"]["cached"] == 0 and out["cold_f"]["cached"] == 0
    assert out["local_p"]["cached"] == 4 * chunk and out["local_m"]["cached"] == chunk
    return out


def worker_state(worker: Any, url: str | None = None) -> dict[str, Any]:
    """In one worker's process: its connector's rank, first layer group, layer count, namespace and totals (after
    its saves are flushed), and, with ``url``, whether its last load's slots hold its stored objects' bits ("ok" or
    the assertion)."""
    from tests.support.engine import worker_connector

    conn = worker_connector()
    conn.flush(120)
    w = conn.worker
    check = None
    if url is not None:
        try:
            assert_paged_kv_equals_stored(conn, url)
            check = "ok"
        except AssertionError as exc:
            check = f"rank {w.tp_rank}, groups from {w.first_group}: {exc}"
    return {"tp_rank": w.tp_rank, "first_group": w.first_group, "layers": len(w.caches), "saves": w.config.save,
            "namespace": dataclasses.replace(w.namespace), "stats": conn.stats(), "check": check}


def loaded(state: dict[str, Any]) -> int:
    return int(state["stats"].get("loaded_tokens", 0))


def scheduler_stat(name: str) -> float:
    from vllm_kvcodec.connector.facade import live_connectors

    schedulers = [c for c in live_connectors() if c.scheduler is not None]
    return schedulers[-1].stats().get(name, 0)


# ---- the loading engine's cases, alike for ranks and stages ----------------------------------------------------
def assert_every_worker_loads_bit_exactly(loader: Any, saved: dict[str, Any], text: list[int], url: str,
                                          chunk: int) -> None:
    before = loader.collective_rpc(worker_state)
    got = generate(loader, prompts(text)["p"])
    assert got == saved["local_p"], "tokens and cached tokens of the local-prefix-cache run"
    after = loader.collective_rpc(worker_state, args=(url,))
    for b, a in zip(before, after):
        assert a["check"] == "ok", a["check"]  # this worker's paged KV is its stored objects' bits
        assert loaded(a) - loaded(b) == 4 * chunk and not a["stats"].get("load_failures"), a


def assert_a_missing_object_is_a_miss_for_all(loader: Any, saved: dict[str, Any], text: list[int], url: str,
                                              chunk: int, tp_rank: int, group: int) -> None:
    """The object (``tp_rank``, ``group``) of M's second chunk is gone: the lookup stops before that chunk; no worker
    loads it."""
    from storage import open_store
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    namespace = saved["workers"][0]["namespace"]
    m = prompts(text)["m"]
    second = chunk_hashes(namespace, m, 2)[1]
    with open_store(url) as store:
        store.delete(object_key(namespace, second, tp_rank, group))
    before = loader.collective_rpc(worker_state)
    hits = scheduler_stat("hit_chunks")
    got = generate(loader, m)
    assert scheduler_stat("hit_chunks") - hits == 1, "the first chunk only"
    assert got == saved["local_m"], "the tokens and cached tokens of a one-chunk local hit"
    after = loader.collective_rpc(worker_state, args=(url,))
    for b, a in zip(before, after):
        assert a["check"] == "ok", a["check"]
        assert loaded(a) - loaded(b) == chunk and not a["stats"].get("load_failures"), a


def assert_one_failed_load_is_recomputed_by_all(loader: Any, saved: dict[str, Any], text: list[int], url: str,
                                                tp_rank: int, group: int, failing_worker: int) -> None:
    """The object (``tp_rank``, ``group``) of F's first chunk is corrupted after it was saved (the lookup finds it;
    its checksum fails on ``failing_worker`` only): vLLM recomputes the prompt on every worker, and each worker's
    KV is what the saving run computed."""
    from storage import open_store
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    namespace = saved["workers"][0]["namespace"]
    f = prompts(text)["f"]
    key = object_key(namespace, chunk_hashes(namespace, f, 1)[0], tp_rank, group)
    with open_store(url) as store:
        good = store.get(key)
        blob = bytearray(good)
        blob[len(blob) // 2] ^= 0x40
        store.put(key, bytes(blob))
    before = loader.collective_rpc(worker_state)
    failed = scheduler_stat("failed_load_chunks")
    got = generate(loader, f)
    assert got["tokens"] == saved["cold_f"]["tokens"], "a full recompute's tokens"
    assert scheduler_stat("failed_load_chunks") - failed >= 1
    after = loader.collective_rpc(worker_state)
    failures = [a["stats"].get("load_failures", 0) - b["stats"].get("load_failures", 0) for b, a in zip(before, after)]
    others = [n for i, n in enumerate(failures) if i != failing_worker]
    assert others == [0] * len(others) and failures[failing_worker] >= 1, failures  # only that worker's load failed
    with open_store(url) as store:
        store.put(key, good)  # the saving run's bits (the recompute saved the chunk again; compare with those)
    checks = loader.collective_rpc(worker_state, args=(url,))
    assert [c["check"] for c in checks] == ["ok"] * len(checks), checks  # it recomputed what the saving run did
