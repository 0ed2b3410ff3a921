"""The element types a chunk can hold, with the wire codes the chunk format uses.

Codecs work on the raw bit patterns (unsigned integers of the element's width),
so NaN payloads, signed zeros and subnormals survive untouched.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from vllm_kvcodec.errors import ChunkFormatError, UnsupportedDTypeError


class DType(enum.IntEnum):
    """Wire code of an element type (one byte in the chunk header)."""

    BFLOAT16 = 1
    FLOAT16 = 2
    FLOAT32 = 3

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH[self]

    @property
    def bits_dtype(self) -> np.dtype:
        """Unsigned integer dtype with the same width, used for bit-exact handling."""
        return np.dtype(np.uint32) if self is DType.FLOAT32 else np.dtype(np.uint16)

    @property
    def itemsize(self) -> int:
        return self.bits_dtype.itemsize

    @property
    def exponent_bits(self) -> int:
        return {DType.BFLOAT16: 8, DType.FLOAT16: 5, DType.FLOAT32: 8}[self]

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DType":
        for code, tdt in _TORCH.items():
            if tdt == dtype:
                return code
        raise UnsupportedDTypeError(
            f"unsupported KV dtype {dtype}; chunks hold bfloat16, float16 or float32"
        )

    @classmethod
    def from_wire(cls, code: int) -> "DType":
        try:
            return cls(code)
        except ValueError:
            raise ChunkFormatError(f"unknown dtype code {code}") from None

    @classmethod
    def parse(cls, name: str | torch.dtype | "DType") -> "DType":
        """Accept 'bfloat16'/'bf16'/torch.bfloat16/DType alike (configs, CLI)."""
        if isinstance(name, DType):
            return name
        if isinstance(name, torch.dtype):
            return cls.from_torch(name)
        key = str(name).lower().removeprefix("torch.")
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        key = aliases.get(key, key)
        try:
            return cls[key.upper()]
        except KeyError:
            raise UnsupportedDTypeError(f"unsupported KV dtype {name!r}") from None


_TORCH = {DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16, DType.FLOAT32: torch.float32}


def tensor_to_bits(kv: torch.Tensor) -> tuple[np.ndarray, DType]:
    """View a CPU tensor's bits as a contiguous unsigned numpy array (no copy when contiguous)."""
    dtype = DType.from_torch(kv.dtype)
    kv = kv.detach().cpu().contiguous()
    view = torch.int32 if dtype is DType.FLOAT32 else torch.int16
    return kv.view(view).numpy().view(dtype.bits_dtype), dtype


def bits_to_tensor(bits: np.ndarray, dtype: DType) -> torch.Tensor:
    """Inverse of :func:`tensor_to_bits`; shares memory with ``bits``."""
    signed = np.int32 if dtype is DType.FLOAT32 else np.int16
    return torch.from_numpy(np.ascontiguousarray(bits).view(signed)).view(dtype.torch_dtype)
