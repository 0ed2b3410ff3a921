"""Tensors that break naive float codecs (special values, every exponent, escape-heavy data), and damaged payloads."""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
              torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_VIEW[t.dtype])


def from_bits(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    unsigned, signed = (np.uint32, np.int32) if dtype == torch.float32 else (np.uint16, np.int16)
    return torch.from_numpy(bits.astype(unsigned).view(signed)).view(dtype)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with payloads, +-Inf, +-0, subnormals, max/min normals."""
    if dtype == torch.float32:
        words = [0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x0, 0x80000000,
                 0x1, 0x807FFFFF, 0x7F7FFFFF, 0x00800000, 0x3F800000]
    elif dtype == torch.float16:
        words = [0x7E01, 0xFE55, 0x7C01, 0x7C00, 0xFC00, 0x0, 0x8000, 0x1, 0x83FF, 0x7BFF, 0x0400, 0x3C00]
    else:
        words = [0x7FC1, 0xFFAB, 0x7F81, 0x7F80, 0xFF80, 0x0, 0x8000, 0x1, 0x807F, 0x7F7F, 0x0080, 0x3F80]
    return from_bits(np.array(words, dtype=np.uint64), dtype)


def every_exponent(dtype: torch.dtype, repeat: int = 3) -> torch.Tensor:
    """All 2**E exponents with random signs and mantissas (escape-heavy for a 16-entry codebook)."""
    rng = np.random.default_rng(1)
    if dtype == torch.float32:
        e = np.repeat(np.arange(256, dtype=np.uint64), repeat)
        words = (rng.integers(0, 2, e.size, dtype=np.uint64) << 31) | (e << 23) | rng.integers(0, 1 << 23, e.size, dtype=np.uint64)
    elif dtype == torch.float16:
        e = np.repeat(np.arange(32, dtype=np.uint64), repeat)
        words = (rng.integers(0, 2, e.size, dtype=np.uint64) << 15) | (e << 10) | rng.integers(0, 1 << 10, e.size, dtype=np.uint64)
    else:
        e = np.repeat(np.arange(256, dtype=np.uint64), repeat)
        words = (rng.integers(0, 2, e.size, dtype=np.uint64) << 15) | (e << 7) | rng.integers(0, 128, e.size, dtype=np.uint64)
    return from_bits(rng.permutation(words), dtype)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Uniformly random bit patterns: the worst case for every exponent codec."""
    rng = np.random.default_rng(seed)
    width = 32 if dtype == torch.float32 else 16
    words = rng.integers(0, 1 << width, int(np.prod(shape)), dtype=np.uint64)
    return from_bits(words, dtype).reshape(shape)


def torch_random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, subnormals included) drawn from a torch generator."""
    wide = torch.int32 if dtype.itemsize == 4 else torch.int16
    info = torch.iinfo(wide)
    return torch.randint(info.min, info.max, shape, dtype=wide, generator=generator).view(dtype)


def reseal(body: bytes | bytearray) -> bytes:
    """Recompute a chunk's trailer, so a test reaches the validation behind the checksum."""
    body = bytes(body[:-8])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


SCALE_DAMAGE = ("zero step", "nan step", "inf minimum", "truncated scales")


def bad_scales_payload(parts, damage: str) -> bytes:
    """A ``quantized`` payload (its :class:`~vllm_kvcodec.codecs.quantized.Unpacked` ``parts``) whose key scales are
    what a broken or tampering writer leaves (one of :data:`SCALE_DAMAGE`): a zero step (a zero range), a NaN step,
    an infinite minimum, or a scales section shorter than its size says. Everything else is the good payload's."""
    from vllm_kvcodec.codecs.dtypes import DType
    from vllm_kvcodec.codecs.quantized import _SCALES, _half
    from vllm_kvcodec.codecs.rans import encode_plane

    k_min, k_step = parts.k_min.copy(), parts.k_step.copy()
    if damage == "zero step":
        k_step[0, 0, 0] = 0.0
    elif damage == "nan step":
        k_step[0, 1, 2] = np.nan
    elif damage == "inf minimum":
        k_min[0, 1, 5] = np.inf
    scales = _SCALES.encode(np.concatenate([_half(a) for a in (k_min, k_step, parts.v_min, parts.v_step)]),
                            DType.BFLOAT16)
    size = np.uint32(len(scales)).tobytes()
    if damage == "truncated scales":
        scales = scales[: len(scales) // 2]  # the section runs into what follows it
    return b"".join((size, scales, parts.kept.tobytes(), encode_plane(parts.keys.reshape(-1)),
                     encode_plane(parts.values.reshape(-1))))
