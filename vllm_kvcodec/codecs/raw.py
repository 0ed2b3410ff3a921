"""The identity codec: the fastest choice on a fast link, and the reference for ratios."""

from __future__ import annotations

import numpy as np

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.registry import register_codec
from vllm_kvcodec.codecs.validate import expect_size
from vllm_kvcodec.codecs.dtypes import DType


@register_codec
class RawCodec(Codec):
    """Little-endian element bits, as they are in memory."""

    codec_id = "raw"

    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        return np.ascontiguousarray(bits, dtype=dtype.bits_dtype.newbyteorder("<")).tobytes()

    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        return self._view(payload, dtype, shape).astype(dtype.bits_dtype, copy=True)

    def decode_borrowed(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        """The payload itself, read-only (on little-endian hosts: no copy at all)."""
        view = self._view(payload, dtype, shape)
        if view.dtype != dtype.bits_dtype:  # a big-endian host: the bytes need swapping, which is a copy
            return view.astype(dtype.bits_dtype, copy=True)
        view.flags.writeable = False
        return view

    @staticmethod
    def _view(payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        expect_size("raw payload", len(payload), n * dtype.itemsize)
        return np.frombuffer(payload, dtype=dtype.bits_dtype.newbyteorder("<"), count=n).reshape(shape)
