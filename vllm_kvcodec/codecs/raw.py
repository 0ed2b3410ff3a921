"""The identity codec: the fastest choice on a fast link, and the reference for ratios."""

from __future__ import annotations

import numpy as np

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.registry import register_codec
from vllm_kvcodec.codecs.validate import expect_size
from vllm_kvcodec.dtypes import DType


@register_codec
class RawCodec(Codec):
    """Little-endian element bits, as they are in memory."""

    codec_id = "raw"

    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        return np.ascontiguousarray(bits, dtype=dtype.bits_dtype.newbyteorder("<")).tobytes()

    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        expect_size("raw payload", len(payload), n * dtype.itemsize)
        out = np.frombuffer(payload, dtype=dtype.bits_dtype.newbyteorder("<"), count=n)
        return out.astype(dtype.bits_dtype, copy=True).reshape(shape)
