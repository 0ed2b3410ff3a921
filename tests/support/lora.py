"""Tiny LoRA adapters for SmolLM2, made with PEFT (no hub): what vLLM loads with ``LoRARequest``."""

from __future__ import annotations

from pathlib import Path


def make_adapter(folder: Path, seed: int, rank: int = 8) -> Path:
    """A rank-``rank`` adapter on q_proj and v_proj with random (non-zero) weights: its V, hence its KV, differs
    from the base model's and from any other seed's. Written as PEFT writes one (adapter_config.json and
    adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from vllm_kvcodec.tools.smollm2 import model_dir

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():  # small weights: a different adapter, still a sane model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.05)
    model.save_pretrained(folder)
    return folder
