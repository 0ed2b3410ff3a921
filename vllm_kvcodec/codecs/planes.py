"""Byte-plane split shared by the plane codecs: exponent bytes apart from the rest.

bfloat16 and float32 split into the exponent byte and the sign+mantissa bytes
(the SplitZip split: the sign goes with the mantissa, so the exponent plane is
low-entropy); float16, whose 5-bit exponent does not fill a byte, splits into
its high and low bytes. Planes are returned concatenated, exponent-like plane
first.
"""

from __future__ import annotations

import numpy as np

from vllm_kvcodec.dtypes import DType


def split_planes(flat: np.ndarray, dtype: DType) -> bytes:
    if dtype is DType.FLOAT16:
        pairs = flat.astype("<u2").view(np.uint8).reshape(-1, 2)
        return pairs[:, 1].tobytes() + pairs[:, 0].tobytes()
    from vllm_kvcodec.codecs.rans import split

    exps, signman = split(flat, dtype)
    return exps.tobytes() + np.ascontiguousarray(signman.reshape(flat.size, -1).T).tobytes()


def merge_planes(buf: bytes, dtype: DType, n: int) -> np.ndarray:
    """Inverse of :func:`split_planes`; ``len(buf)`` must already equal ``n * itemsize``."""
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(dtype.itemsize, n)
    if dtype is DType.FLOAT16:
        return (planes[0].astype(np.uint16) << 8) | planes[1]
    from vllm_kvcodec.codecs.rans import merge

    return merge(planes[0], np.ascontiguousarray(planes[1:].T), dtype)
