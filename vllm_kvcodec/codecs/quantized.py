"""``quantized``: a lossy codec. KV as ``bits``-bit integers with KIVI's scales, the integers coded losslessly.

LOSSY: NOT BIT-EXACT. Only a ``precision`` level names it (:mod:`.precision`);
the lossless policy refuses it everywhere else.

What it stores, for a canonical chunk ``[layers, 2 (K, V), tokens, heads, dim]``:

- **Keys** per channel: each (layer, head, dim) channel's minimum and step over
  the chunk's tokens (KIVI and KVQuant: key outliers sit in fixed channels);
  **values** per token: each (layer, token, head)'s minimum and step over its
  channels. Both are stored as bfloat16, rANS-coded (a float32 pair per 64
  values would cost a bit per value): the minimum rounded down, the step ``(max - min) /
  (2**bits - 1)`` rounded up, so the integers still span the group;
  ``q = rint((x - min) / step)`` in ``[0, 2**bits - 1]`` (step 1.0 where
  max == min: every q is 0 and the minimum is the value, exactly).
- **Kept at full precision**, their source bits raw: the object's first
  ``full_layers`` layers and the chunk's first ``sink_tokens`` tokens (set for
  a sequence's first chunk: CacheGen and KVQuant keep the attention sinks
  exact).
- The integers: keys and values as two planes, each order-0 rANS-coded under
  its own table (``entropy: rans``; :func:`~.rans.encode_plane`). Lossless
  HEVC in KVCodec's token-per-frame layout, HEVC in a naive layout and FFV1
  were measured on the same integers and lost (``kvcodec bench layouts``,
  docs/codec-video.md): KIVI's integers hold nothing for their predictors.

The reference dequantisation, which every decoder reproduces bit for bit (the
GPU kernel too): ``y = float32(q) * step`` rounded to float32, ``+ min``
rounded to float32 (two roundings, no fused multiply-add), then rounded to the
source dtype to nearest even. ``|y - x| <= step / 2`` before that last rounding.

Payload (little-endian; ``Lq = layers - full_layers``, ``Tq = tokens - sink_tokens``)::

    scales_size     u32
    scales          rans (bfloat16, one channel) of k_min, k_step (Lq*heads*dim each), v_min, v_step
                    (Lq*Tq*heads each)
    kept            full_layers*2*tokens*heads*dim + Lq*2*sink_tokens*heads*dim elements, source bits
    keys            rANS plane of Lq*Tq*heads*dim symbols
    values          rANS plane of Lq*Tq*heads*dim symbols

Decoding is untrusted input like any other: every size follows from the
header's shape and this codec's config and is checked before anything is
allocated; a step that is not finite and positive, a minimum that is not
finite, or an integer above ``2**bits - 1`` is a :class:`CodecError` (a failed
load, recomputed), never a value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.dtypes import DType, bits_to_tensor, tensor_to_bits
from vllm_kvcodec.codecs.rans import RansCodec, encode_plane, read_plane
from vllm_kvcodec.codecs.registry import register_codec
from vllm_kvcodec.codecs.validate import Reader
from vllm_kvcodec.errors import CodecError, ConfigError

ENTROPY = ("rans",)
#: The scales' own coding: bfloat16 exponents rANS-coded, sign and mantissa raw (a third smaller than raw).
_SCALES = RansCodec(token_axis=0)


@dataclasses.dataclass(frozen=True)
class Unpacked:
    """A quantized payload's parts: the integers ``[Lq, Tq, heads, dim]`` of keys and values, their minimums and
    steps (float32 holding bfloat16 values; keys ``[Lq, heads, dim]``, values ``[Lq, Tq, heads]``), and the kept
    full-precision values' source bits (full layers first, then the other layers' sink tokens)."""

    keys: np.ndarray
    values: np.ndarray
    k_min: np.ndarray
    k_step: np.ndarray
    v_min: np.ndarray
    v_step: np.ndarray
    kept: np.ndarray


class NonFiniteKVError(CodecError):
    """The chunk holds NaN or inf: no scale represents it; such a chunk is saved lossless only."""


@register_codec
class QuantizedCodec(Codec):
    codec_id = "quantized"
    lossless = False
    dtypes = frozenset({DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32})

    def __init__(self, bits: int = 8, sink_tokens: int = 0, full_layers: int = 0, entropy: str = "rans") -> None:
        if not isinstance(bits, int) or not 2 <= bits <= 8:
            raise ConfigError(f"quantized bits must be an integer in [2, 8], got {bits!r}")
        for name, value in (("sink_tokens", sink_tokens), ("full_layers", full_layers)):
            if not isinstance(value, int) or not 0 <= value < 1 << 16:
                raise ConfigError(f"quantized {name} must be an integer in [0, 65536), got {value!r}")
        if entropy not in ENTROPY:
            raise ConfigError(f"quantized entropy {entropy!r} is not one of {', '.join(ENTROPY)}")
        self.bits, self.sink_tokens, self.full_layers, self.entropy = bits, sink_tokens, full_layers, entropy

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"id": self.codec_id, "bits": self.bits, "entropy": self.entropy}
        if self.sink_tokens:
            config["sink_tokens"] = self.sink_tokens
        if self.full_layers:
            config["full_layers"] = self.full_layers
        return config

    # ---- encode ---------------------------------------------------------------------
    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        x = bits_to_tensor(np.ascontiguousarray(bits), dtype).float().numpy()
        self._geometry(x.shape)
        if not np.isfinite(x).all():
            raise NonFiniteKVError("the chunk holds NaN or inf values: no quantisation step represents them "
                                   "(save it lossless)")
        full, sink = self.full_layers, self.sink_tokens
        k = x[full:, 0, sink:]  # [Lq, Tq, H, D]: per channel, over tokens
        v = x[full:, 1, sink:]  # [Lq, Tq, H, D]: per token, over channels
        k_min, k_step = _steps(k.min(axis=1), k.max(axis=1), self.levels)
        v_min, v_step = _steps(v.min(axis=3), v.max(axis=3), self.levels)
        k_q = _quantize(k, k_min[:, None], k_step[:, None], self.levels)
        v_q = _quantize(v, v_min[..., None], v_step[..., None], self.levels)
        scales = _SCALES.encode(np.concatenate([_half(a) for a in (k_min, k_step, v_min, v_step)]), DType.BFLOAT16)
        return b"".join((np.uint32(len(scales)).tobytes(), scales,
                         self._kept(np.ascontiguousarray(bits), dtype).tobytes(),
                         encode_plane(k_q.reshape(-1)), encode_plane(v_q.reshape(-1))))

    def _kept(self, bits: np.ndarray, dtype: DType) -> np.ndarray:
        """The source bits of the full-precision layers, then of the sink tokens of the other layers."""
        le = dtype.bits_dtype.newbyteorder("<")
        return np.concatenate([bits[: self.full_layers].reshape(-1).astype(le),
                               bits[self.full_layers :, :, : self.sink_tokens].reshape(-1).astype(le)])

    # ---- decode ---------------------------------------------------------------------
    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        chunk = self.unpack(payload, dtype, shape)
        full, sink = self.full_layers, self.sink_tokens
        layers, _, tokens, heads, dim = shape
        lq = layers - full
        out = np.empty(shape, dtype=dtype.bits_dtype)
        cut = full * 2 * tokens * heads * dim
        out[:full] = chunk.kept[:cut].reshape(full, 2, tokens, heads, dim)
        out[full:, :, :sink] = chunk.kept[cut:].reshape(lq, 2, sink, heads, dim)
        out[full:, 0, sink:] = _to_bits(dequantize(chunk.keys, chunk.k_min[:, None], chunk.k_step[:, None]), dtype)
        out[full:, 1, sink:] = _to_bits(dequantize(chunk.values, chunk.v_min[..., None], chunk.v_step[..., None]), dtype)
        return out

    def unpack(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> "Unpacked":
        """The payload's parts, every size and scale checked: what :meth:`decode` dequantises (and what a test or
        a device kernel reads the integers and scales from)."""
        layers, _, tokens, heads, dim = self._geometry(shape)
        full, sink = self.full_layers, self.sink_tokens
        lq, tq = layers - full, tokens - sink
        reader = Reader(payload, "quantized payload")
        nk, nv = lq * heads * dim, lq * tq * heads
        size = reader.u32("scales size")
        scales = _widen(_SCALES.decode(reader.take(size, "scales"), DType.BFLOAT16, (2 * nk + 2 * nv,)))
        k_min, k_step = scales[:nk].reshape(lq, heads, dim), scales[nk : 2 * nk].reshape(lq, heads, dim)
        v_min = scales[2 * nk : 2 * nk + nv].reshape(lq, tq, heads)
        v_step = scales[2 * nk + nv :].reshape(lq, tq, heads)
        _check_steps(k_min, k_step, "key")
        _check_steps(v_min, v_step, "value")
        kept_n = full * 2 * tokens * heads * dim + lq * 2 * sink * heads * dim
        le = dtype.bits_dtype.newbyteorder("<")
        kept = np.frombuffer(reader.take(kept_n * dtype.itemsize, "kept values"), dtype=le).astype(dtype.bits_dtype)
        keys = self._plane(reader, lq * tq * heads * dim, "key").reshape(lq, tq, heads, dim)
        values = self._plane(reader, lq * tq * heads * dim, "value").reshape(lq, tq, heads, dim)
        reader.finish()
        return Unpacked(keys, values, k_min, k_step, v_min, v_step, kept)

    def _plane(self, reader: Reader, n: int, what: str) -> np.ndarray:
        q = read_plane(reader, n)
        if n and int(q.max()) > self.levels:
            raise CodecError(f"quantized {what} integers exceed {self.levels} ({self.bits} bits)")
        return q

    def _geometry(self, shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
        """``[layers, 2, tokens, heads, dim]``, with room for the full-precision layers and sink tokens."""
        if len(shape) != 5 or shape[1] != 2:
            raise CodecError(f"quantized needs a canonical [layers, 2, tokens, heads, dim] chunk, got {tuple(shape)}")
        if self.full_layers > shape[0] or self.sink_tokens > shape[2]:
            raise CodecError(f"quantized keeps {self.full_layers} layers and {self.sink_tokens} tokens of a chunk "
                             f"of {shape[0]} layers and {shape[2]} tokens")
        return tuple(int(s) for s in shape)  # type: ignore[return-value]


def dequantize(q: np.ndarray, minimum: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The reference dequantisation in float32: ``q * step`` rounded, ``+ minimum`` rounded (no fused multiply-add:
    numpy rounds each ufunc's result), as every decoder reproduces it."""
    product = np.multiply(q.astype(np.float32), step, dtype=np.float32)
    return np.add(product, minimum, dtype=np.float32)


def _steps(low: np.ndarray, high: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(minimum, step) per group, each a bfloat16 value (held in float32): the minimum rounded down, the step up,
    so that ``minimum + levels * step`` still reaches the maximum and every value lies within half a step of its
    integer's value. A group of one value gets step 1.0 (all its integers are 0, its value the minimum)."""
    low = _bf16(low.astype(np.float32), toward=-1)
    step = _bf16(np.divide(high.astype(np.float32) - low, np.float32(levels), dtype=np.float32), toward=1)
    while (bad := np.add(np.multiply(step, np.float32(levels), dtype=np.float32), low, dtype=np.float32) < high).any():
        step = np.where(bad, _bf16(np.nextafter(step, np.float32(np.inf)), toward=1), step)  # float32 rounding
    step = np.where(step > 0, step, np.float32(1.0)).astype(np.float32)
    return np.ascontiguousarray(low), np.ascontiguousarray(step)


def _bf16(x: np.ndarray, toward: int) -> np.ndarray:
    """``x`` rounded to bfloat16 values toward -inf (``toward`` -1) or +inf (1), as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    low = (bits & np.uint32(0xFFFF0000)).view(np.float32)  # truncated: toward zero
    inexact = (bits & np.uint32(0xFFFF)) != 0
    away = inexact & ((x > 0) if toward > 0 else (x < 0))
    ulp = np.uint32(0x10000)
    return np.where(away, ((bits & np.uint32(0xFFFF0000)) + ulp).view(np.float32), low).astype(np.float32)


def _quantize(x: np.ndarray, minimum: np.ndarray, step: np.ndarray, levels: int) -> np.ndarray:
    q = np.rint(np.divide(x - minimum, step, dtype=np.float32))
    return np.clip(q, 0, levels).astype(np.uint8)


def _half(x: np.ndarray) -> np.ndarray:
    """bfloat16 values held in float32, as their 16-bit patterns."""
    return (np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32) >> 16).astype(np.uint16)


def _widen(half: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns as float32 values, exactly."""
    return (half.astype(np.uint32) << 16).view(np.float32)


def _check_steps(minimum: np.ndarray, step: np.ndarray, what: str) -> None:
    if not np.isfinite(minimum).all():
        raise CodecError(f"quantized {what} minimums are not all finite")
    if not (np.isfinite(step).all() and (step > 0).all()):
        raise CodecError(f"quantized {what} steps are not all finite and positive")


def _to_bits(y: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values rounded to the source dtype (to nearest even), as its bit patterns."""
    bits, _ = tensor_to_bits(torch.from_numpy(np.ascontiguousarray(y)).to(dtype.torch_dtype))
    return bits
