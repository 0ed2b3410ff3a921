"""Whose rows a tier reads: only those of engines that compute the same KV, whatever vLLM's offload key says.

vLLM's offload key is its block hash: the tokens (and LoRA name, media,
cache_salt), not the weights or the model configuration. Each engine here is
vLLM's own scheduler side with KVCodecTier (tests/support/offload_engine.py),
with its VllmConfig made by EngineArgs from a real model folder; one engine
stores rows of real SmolLM2 KV, another one of a different kind asks vLLM's
question (how many tokens can be loaded) for the same prompt on the same store.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.offload_engine import BLOCK, OffloadEngine

ROWS = 4  # blocks stored and loaded, of the prompt's 8


@pytest.fixture
def kv(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:ROWS]


def saved(e: OffloadEngine, tokens: list[int], rows: torch.Tensor) -> OffloadEngine:
    req = e.request(tokens)
    assert e.hit_tokens(req) == 0
    e.save(req, rows)
    assert e.tier.counters["stored_rows"] == len(rows)
    return e


def loads(e: OffloadEngine, tokens: list[int]) -> torch.Tensor | None:
    """What a fresh request of ``tokens`` loads through the tier: its rows, or None when vLLM is told of no hit."""
    req = e.request(tokens)
    hit = e.hit_tokens(req)
    if hit == 0:
        assert e.tier.counters["loaded_rows"] == 0
        return None
    assert hit == ROWS * BLOCK
    return e.loaded_rows(req, ROWS)


def test_a_fine_tune_deployed_at_the_same_path_never_reads_the_base_models_rows(engine, tokens, kv,
                                                                                tmp_path: Path) -> None:
    """One path, other weights (a fine-tune copied over the model folder): vLLM's OffloadingConfig names the same
    model, the tier's namespace fingerprints the weights."""
    from vllm_kvcodec.tools.smollm2 import model_dir

    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for source in model_dir().iterdir():  # the model, deployed here (links: the weights are rewritten below)
        (folder / source.name).symlink_to(source)
    store = f"memory://offload-{uuid.uuid4().hex}"
    base = saved(engine(store, model=folder), tokens, kv)
    same = loads(engine(store, model=folder), tokens)  # the same weights at the same path: shared
    assert same is not None and torch.equal(same[:, : kv.shape[1]], kv)
    weights = next(folder.glob("*.safetensors"))
    data = np.fromfile(weights, dtype=np.uint8)
    data[len(data) // 2 :] ^= 0x01  # a "fine-tune": the second half of the weights differs
    weights.unlink()
    data.tofile(weights)  # deployed over the base model's weights
    tuned = engine(store, model=folder)
    assert loads(tuned, tokens) is None
    assert tuned.config.model_config.model == base.config.model_config.model  # what vLLM tells its tiers: equal
    assert tuned.tier.namespace.model_id != base.tier.namespace.model_id  # what the tier keys by: not


@pytest.mark.parametrize("differs", [
    {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}},  # config_inputs
    {"enforce_eager": False},  # compiled kernels round differently (compute_identity)
], ids=["hf_overrides", "compiled"])
def test_engines_that_differ_only_in_configuration_each_read_only_their_own_rows(engine, tokens, kv,
                                                                                 differs: dict) -> None:
    """Same weights, same path, same tokens, same offload keys: each kind of engine stores its own rows (other KV)
    under them and loads only those."""
    store = f"memory://offload-{uuid.uuid4().hex}"
    theirs = kv.roll(1, dims=1)  # stands for the KV the other configuration computes
    saved(engine(store), tokens, kv)
    other = engine(store, **differs)
    assert loads(other, tokens) is None
    saved(other, tokens, theirs)
    mine = loads(engine(store), tokens)
    assert mine is not None and torch.equal(mine[:, : kv.shape[1]], kv)
    again = loads(engine(store, **differs), tokens)
    assert again is not None and torch.equal(again[:, : kv.shape[1]], theirs)


def test_an_fp8_cache_is_keyed_with_the_dtype_its_model_computes_in(engine) -> None:
    """fp8 rows of a bfloat16 engine and a float32 one hold other bytes for the same tokens (each rounds its K and V
    before quantising them): the tier's namespace names the compute dtype, as the connector's does."""
    store = f"memory://offload-{uuid.uuid4().hex}"
    bf16 = engine(store, kv_cache_dtype="fp8", dtype="bfloat16").tier.namespace
    fp32 = engine(store, kv_cache_dtype="fp8", dtype="float32").tier.namespace
    assert (bf16.dtype, bf16.compute_dtype, fp32.compute_dtype) == ("fp8_e4m3", "bfloat16", "float32")
    assert bf16.digest != fp32.digest
