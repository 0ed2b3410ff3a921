"""vLLM's KV cache groups as the connector reads them: what is covered, and every refusal by name.

Real vLLM spec objects (vllm.v1.kv_cache_interface), no engine: this is what
``kv_cache_config`` hands the connector at start-up.
"""

from __future__ import annotations


import pytest
import torch

from vllm_kvcodec.connector.cache_groups import cache_groups_for, layer_index, load_mode
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError


def specs():
    from vllm.v1 import kv_cache_interface as kv

    return kv


def attn(cls_name: str, **kw):
    kv = specs()
    base = {"block_size": 128, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    return getattr(kv, cls_name)(**{**base, **kw})


def config(*group_specs, names=None):
    kv = specs()
    groups = [kv.KVCacheGroupSpec([f"model.layers.{i}.attn"] if names is None else names[i], s)
              for i, s in enumerate(group_specs)]
    return kv.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_covered_kinds() -> None:
    groups = cache_groups_for(config(attn("SlidingWindowSpec", sliding_window=512), attn("FullAttentionSpec")), 128, 256)
    assert [(g.kind, g.window, g.label) for g in groups.groups] == [("window", 512, "window:512"), ("full", None, "full")]
    assert groups.multi and groups.hit_alignment == 128
    assert groups.attention(["model.layers.0.attn", "model.layers.1.attn"]) == "window:512,full"
    assert groups.freed_below(0, 1000) == (1000 - 511) // 128 * 128 and groups.freed_below(1, 1000) == 0
    no_hma = cache_groups_for(config(attn("FullAttentionSpec", sliding_window=512)), 128, 256)
    assert not no_hma.multi and no_hma.groups[0].window is None and no_hma.groups[0].label == "window:512"
    assert cache_groups_for(None, 128, 256).groups[0].kind == "full"
    fp8 = attn("FullAttentionSpec", kv_quant_mode=specs().KVQuantMode.FP8_PER_TENSOR)
    assert cache_groups_for(config(fp8), 128, 256).groups[0].label == "full"
    assert layer_index("model.layers.12.self_attn.attn") == 12


def test_latent_attention_is_a_full_group_that_the_namespace_calls_latent() -> None:
    mla = specs().MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    groups = cache_groups_for(config(mla), 16, 256)
    assert [(g.kind, g.window, g.label) for g in groups.groups] == [("full", None, "latent")]
    assert not groups.multi and groups.attention(["model.layers.0.attn"]) == "latent"  # never a K/V cache's key


@pytest.mark.parametrize("make,message", [
    (lambda kv: kv.MambaSpec(block_size=128, shapes=((3, 512),), dtypes=(torch.bfloat16,),
                             mamba_type=kv.MambaAttentionBackendEnum.GDN_ATTN), "Gated DeltaNet .*Qwen3-Next"),
    (lambda kv: kv.MambaSpec(block_size=128, shapes=((3, 512),), dtypes=(torch.bfloat16,),
                             mamba_type=kv.MambaAttentionBackendEnum.MAMBA1), "Mamba1 state \\(Jamba"),
    (lambda kv: kv.MambaSpec(block_size=128, shapes=((3, 512),), dtypes=(torch.bfloat16,),
                             mamba_type=kv.MambaAttentionBackendEnum.MAMBA2), "Mamba2 state \\(Bamba, Granite-4"),
    (lambda kv: kv.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                    cache_dtype_str="fp8_ds_mla"), "latent attention with a fp8_ds_mla cache"),
    (lambda kv: kv.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                    model_version="deepseek_v4"), "model_version=deepseek_v4"),
    (lambda kv: attn("ChunkedLocalAttentionSpec", attention_chunk_size=8192), "chunked local attention \\(Llama 4\\)"),
    (lambda kv: attn("FullAttentionSpec", attention_chunk_size=8192), "chunked local attention"),
    (lambda kv: attn("SinkFullAttentionSpec", sink_len=4), "sink tokens"),
    (lambda kv: attn("CrossAttentionSpec"), "cross attention"),
    (lambda kv: attn("EncoderOnlyAttentionSpec"), "encoder-only"),
    (lambda kv: kv.SlidingWindowMLASpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                        sliding_window=128), "DeepSeek-V4"),
    (lambda kv: attn("FullAttentionSpec", kv_quant_mode=kv.KVQuantMode.NVFP4), "NVFP4 quantised"),
    (lambda kv: attn("FullAttentionSpec", kv_quant_mode=kv.KVQuantMode.INT8_PER_TOKEN_HEAD), "INT8_PER_TOKEN_HEAD"),
    (lambda kv: attn("FullAttentionSpec", tokens_per_state=4), "packs or compresses tokens"),
], ids=["gdn", "mamba1", "mamba2", "mla-fp8-ds", "mla-v4", "chunked-local", "chunked-local-full", "sinks", "cross", "encoder", "swa-mla",
        "nvfp4", "int8", "compressed"])
def test_refused_kinds_are_named(make, message) -> None:
    group = make(specs())
    with pytest.raises(ConfigError, match=f"KV cache group 1 .*{message}"):
        cache_groups_for(config(attn("FullAttentionSpec"), group), 128, 256)


def test_unknown_specs_and_untransferable_groups_are_refused() -> None:
    kv = specs()

    class FutureSpec(kv.FullAttentionSpec):
        pass

    with pytest.raises(ConfigError, match="does not know \\(FutureSpec\\); refusing to guess"):
        cache_groups_for(config(attn("FullAttentionSpec"), FutureSpec(block_size=128, num_kv_heads=2, head_size=64,
                                                                       dtype=torch.bfloat16)), 128, 256)
    cfg = config(attn("FullAttentionSpec"))
    cfg.kv_cache_groups[0].enable_kv_transfer = False
    with pytest.raises(ConfigError, match="not transferable"):
        cache_groups_for(cfg, 128, 256)


def test_window_and_alignment_limits() -> None:
    with pytest.raises(ConfigError, match="chunk_size <= 300"):
        cache_groups_for(config(attn("SlidingWindowSpec", sliding_window=300)), 128, 512)
    mixed = cache_groups_for(config(attn("FullAttentionSpec"), attn("FullAttentionSpec", block_size=96)), 128, 256)
    assert mixed.hit_alignment == 384
    with pytest.raises(ConfigError, match=r"hit alignment \(384 tokens, the KV cache groups' block sizes \[128, 96\]"):
        ConnectorConfig(chunk_size=256).for_engine("kv_both", 128, mixed.hit_alignment,
                                                   alignment_from=mixed.alignment_source)


def test_load_mode_is_async_with_several_groups() -> None:
    two = cache_groups_for(config(attn("SlidingWindowSpec", sliding_window=512), attn("FullAttentionSpec")), 128, 256)
    one = cache_groups_for(config(attn("FullAttentionSpec")), 128, 256)
    assert load_mode(ConnectorConfig(), two) == "async" and load_mode(ConnectorConfig(), one) == "sync"
    assert load_mode(ConnectorConfig(load_mode="async"), two) == "async"
    with pytest.raises(ConfigError, match="load_mode 'sync' cannot recover"):
        load_mode(ConnectorConfig(load_mode="sync"), two)
