"""The element types a chunk can hold, with the wire codes the chunk format uses.

Codecs work on the raw bit patterns (unsigned integers of the element's width),
so NaN payloads, signed zeros and subnormals survive untouched.

The two 1-byte float8 formats (codes 4 and 5) hold the bytes of vLLM's fp8 KV
caches (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``) exactly as the
attention kernel wrote them: already quantised, with the layer's scale applied,
never converted again. They were added to format version 1 as an extension:
a reader that predates them refuses their chunks with "unknown dtype code"
(:meth:`DType.from_wire`), which a connector treats as a miss.
"""

from __future__ import annotations

import enum
import warnings

import numpy as np
import torch

from vllm_kvcodec.errors import ChunkFormatError, UnsupportedDTypeError


class DType(enum.IntEnum):
    """Wire code of an element type (one byte in the chunk header)."""

    BFLOAT16 = 1
    FLOAT16 = 2
    FLOAT32 = 3
    FLOAT8_E4M3 = 4  # torch.float8_e4m3fn: vLLM's "fp8" and "fp8_e4m3" caches
    FLOAT8_E5M2 = 5  # torch.float8_e5m2: vLLM's "fp8_e5m2" caches

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH[self]

    @property
    def bits_dtype(self) -> np.dtype:
        """Unsigned integer dtype with the same width, used for bit-exact handling."""
        return _BITS[self]

    @property
    def itemsize(self) -> int:
        return self.bits_dtype.itemsize

    @property
    def exponent_bits(self) -> int:
        return {DType.BFLOAT16: 8, DType.FLOAT16: 5, DType.FLOAT32: 8, DType.FLOAT8_E4M3: 4, DType.FLOAT8_E5M2: 5}[self]

    @property
    def is_float8(self) -> bool:
        """A 1-byte quantised cache format (its bytes carry a per-layer scale the key namespace pins)."""
        return self in (DType.FLOAT8_E4M3, DType.FLOAT8_E5M2)

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DType":
        for code, tdt in _TORCH.items():
            if tdt == dtype:
                return code
        raise UnsupportedDTypeError(
            f"unsupported KV dtype {dtype}; chunks hold bfloat16, float16, float32, "
            "float8_e4m3fn or float8_e5m2"
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
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                   # vLLM's kv_cache_dtype names: "fp8" is E4M3 (csrc/cpu parse_fp8_kv_dtype; CUDA alike)
                   "fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
                   "fp8_e5m2": "float8_e5m2"}
        key = aliases.get(key, key)
        try:
            return cls[key.upper()]
        except KeyError:
            raise UnsupportedDTypeError(f"unsupported KV dtype {name!r}") from None


_TORCH = {
    DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16, DType.FLOAT32: torch.float32,
    DType.FLOAT8_E4M3: torch.float8_e4m3fn, DType.FLOAT8_E5M2: torch.float8_e5m2,
}
_BITS = {
    DType.BFLOAT16: np.dtype(np.uint16), DType.FLOAT16: np.dtype(np.uint16), DType.FLOAT32: np.dtype(np.uint32),
    DType.FLOAT8_E4M3: np.dtype(np.uint8), DType.FLOAT8_E5M2: np.dtype(np.uint8),
}
#: torch integer dtype of each width, for viewing bits (torch has no uint16/uint32 numpy bridge)
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def tensor_to_bits(kv: torch.Tensor) -> tuple[np.ndarray, DType]:
    """View a CPU tensor's bits as a contiguous unsigned numpy array (no copy when contiguous)."""
    dtype = DType.from_torch(kv.dtype)
    kv = kv.detach().cpu().contiguous()
    return kv.view(_SIGNED[dtype.itemsize]).numpy().view(dtype.bits_dtype), dtype


# A borrowed (read-only) decode becomes a tensor that is only ever read (the source of a copy into paged
# memory); torch's one-time warning about non-writable arrays would only alarm whoever reads the logs.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


def bits_to_tensor(bits: np.ndarray, dtype: DType) -> torch.Tensor:
    """Inverse of :func:`tensor_to_bits`; shares memory with ``bits`` (read-only ``bits``: never write the tensor)."""
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[dtype.itemsize]
    return torch.from_numpy(np.ascontiguousarray(bits).view(signed)).view(dtype.torch_dtype)
