"""What the KV cache's bytes mean beyond the model: its element format and, for fp8, the layers' scales.

Two engines of one model can fill their caches with different bytes for the
same tokens: a bf16 cache and an fp8 one, an E4M3 cache and an E5M2 one, or
two fp8 caches whose per-layer scales differ (``quant(x / k_scale)``: the same
byte means another value under another scale; a re-calibrated checkpoint
changes them), or two fp8 caches of engines computing in other dtypes (float32
and bfloat16 K round to other fp8 bytes). All of this goes into the key
namespace, so such engines never share a chunk.

The scales are only known once the worker has loaded the weights (vLLM sets
``layer._k_scale_float`` / ``_v_scale_float`` (and Q's and P's) from the
checkpoint, 1.0 where it has none, and never changes them at run time in 0.32:
its ``calculate_kv_scales``, which computed them from the first batch, is gone). The worker computes
their digest in ``register_kv_caches`` and hands it to the scheduler through
vLLM's connector handshake (``get_handshake_metadata`` ->
``set_xfer_handshake_metadata``), which vLLM delivers before the first request.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable
from typing import Any

import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from vllm_kvcodec.errors import ConfigError

#: vLLM's ``kv_cache_dtype`` names of fp8 caches -> the name the namespace uses ("fp8" stores E4M3 bytes).
FP8_NAMES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def cache_dtype_name(cache_dtype: Any, model_dtype: Any) -> str:
    """The namespace's dtype: the model's for an unquantised cache, ``fp8_e4m3`` / ``fp8_e5m2`` for fp8.

    ``fp8`` and ``fp8_e4m3`` write the same bytes (vLLM's CPU op parses both as
    E4M3, as CUDA does), so they share chunks.
    """
    name = str(cache_dtype or "auto").lower()
    if name in ("auto", "bfloat16", "float16", "half", "float32", "float"):
        return str(model_dtype).removeprefix("torch.") if name == "auto" else str(cache_dtype)
    return FP8_NAMES.get(name, name)


def compute_dtype_name(model_dtype: Any, dtype_name: str) -> str:
    """The namespace's ``compute_dtype``: the model's dtype where the cache holds another, else "".

    An fp8 cache quantises K and V as the model computed them: a float32
    engine and a bfloat16 one round the same token's K to other values first,
    so their fp8 bytes differ too (and so does every later layer's input).
    Where the cache holds the model's own dtype, ``dtype`` names it already.
    """
    name = str(model_dtype).removeprefix("torch.")
    return "" if name == dtype_name else name


def is_fp8(dtype_name: str) -> bool:
    return dtype_name in FP8_NAMES.values()


def check_uniform_cache_dtype(cache_config: Any) -> None:
    """Refuse an fp8 cache with bf16 exceptions: one stored object holds one dtype for all its layers."""
    skip = list(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or [])
    if skip and is_fp8(FP8_NAMES.get(str(cache_config.cache_dtype).lower(), "")):
        raise ConfigError(
            f"kvcodec: kv_cache_dtype {cache_config.cache_dtype!r} with kv_cache_dtype_skip_layers={skip} keeps "
            "some layers unquantised; a stored chunk holds one dtype for all its layers, so mixed-dtype caches "
            "are not supported (drop --kv-cache-dtype-skip-layers, or serve this model without the connector)"
        )


#: A layer's scales as vLLM keeps them on the host: K and V quantise the cache; Q and the softmax's P quantise the
#: attention's inputs on fp8-attention backends (FlashInfer, FlashAttention 3), whose output every later layer reads.
SCALES = ("_k_scale_float", "_v_scale_float", "_q_scale_float", "_prob_scale_float")


def scales_digest(layers: Iterable[Any]) -> str:
    """XXH3-128 of the float32 bits of every layer's ``(k, v, q, prob)`` scales, in layer order (1.0 if unset)."""
    h = xxhash.xxh3_128()
    for layer in layers:
        h.update(struct.pack("<4f", *(float(getattr(layer, name, 1.0)) for name in SCALES)))
    return h.hexdigest()


@dataclasses.dataclass
class KVCodecHandshake(KVConnectorHandshakeMetadata):
    """What one worker tells the scheduler half once its KV caches are registered."""

    kv_scales: str  # scales_digest of its layers ("" for an unquantised cache)
    namespace_digest: str  # the worker's whole namespace, for a cross-check
    # precision auto: its expected seconds per raw byte of each precision's loads, from its start-up probe of the
    # store (save/precision_choice.py), so that the first load chooses by the link too
    read_costs: dict[str, float] | None = None


def agreed_scales(handshakes: dict[int, Any]) -> str:
    """The one scales digest every tensor-parallel worker reported; a disagreement stops the engine."""
    found = {h.kv_scales for h in handshakes.values() if isinstance(h, KVCodecHandshake)}
    if len(found) > 1:
        raise ConfigError(f"kvcodec: workers report different fp8 KV scales ({sorted(found)}); refusing to key chunks")
    if not found:
        raise ConfigError("kvcodec: no worker reported its KV cache identity through the connector handshake")
    return found.pop()
