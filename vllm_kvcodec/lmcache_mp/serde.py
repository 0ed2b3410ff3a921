"""Lossless LMCache MP serdes: each KV group of an L1 object becomes one checksummed, key-bound chunk.

LMCache's serde wrapper (``SerdeL2AdapterWrapper``) calls :meth:`KVCodecSerializer.serialize`
with an L1 KV object and a byte buffer sized by :meth:`estimate_serialized_size`,
then hands the buffer to the wrapped L2 adapter; on a load it fills a buffer of the
same estimated size from L2 and calls :meth:`KVCodecDeserializer.deserialize`.

Two sizing modes, because LMCache 0.5.6's adapters differ in what they can read back:

- **exact** (default): the estimate is a worst-case bound (an incompressible chunk
  is stored with codec ``raw``), and ``serialize`` returns the bytes it wrote, so
  LMCache narrows the buffer and the adapter stores only those. Reading such a
  shorter object back needs an adapter that accepts it: this package's
  :class:`~vllm_kvcodec.lmcache_mp.l2_adapter.KVCodecL2Adapter` does; LMCache
  0.5.6's ``fs`` adapter does not (it wants the whole estimate and reports a miss).
- **fixed** (``fixed_ratio: r``): every object is exactly ``ceil(raw / r)`` bytes,
  padded with zeros, which any adapter reads back. An object that does not compress
  by ``r`` fails to serialize and is not stored (LMCache logs it; the next reader
  recomputes); pick ``r`` below the ratio your model's KV gets (docs/lmcache.md).

Never wrong bytes: the frame, each chunk's checksum, its key binding, dtype and
shape are all checked before a byte reaches the L1 object; any failure raises,
which LMCache's serde processor turns into a failed load (a miss).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lmcache.v1.distributed.serde.base import Deserializer, Serializer

from vllm_kvcodec.codecs import policy
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ChunkFormatError, ConfigError
from vllm_kvcodec.format import CHECKSUM_BYTES, MAX_HEADER_BYTES, decode_payload, encode_chunk, read_header
from vllm_kvcodec.lmcache_mp import frame
from vllm_kvcodec.lmcache_mp.object_keys import group_binding, object_name

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj


class SerdeBudgetError(ValueError):
    """An object did not compress enough to fit a fixed-size serde's buffer; it is not stored."""


class CodecChoice:
    """The codec a serde encodes a dtype with: the one it is named after, or (``auto``) the policy's default per dtype."""

    def __init__(self, serde_name: str, spec: policy.CodecSpec | None) -> None:
        self.serde_name = serde_name
        self._named = policy.lossless_codec(spec) if spec is not None else None
        self._by_dtype: dict[DType, Codec] = {}

    def for_dtype(self, dtype: DType) -> Codec:
        """Raises UnsupportedDTypeError naming the codec and what it holds (fp8 under kvcodec-rans, say)."""
        codec = self._by_dtype.get(dtype)
        if codec is None:
            if self._named is None:
                codec = policy.lossless_codec(policy.default_codec_for(dtype))
            else:
                codec = self._named
                codec.check_dtype(dtype)
            self._by_dtype[dtype] = codec
        return codec


def raw_nbytes(layout_desc: MemoryLayoutDesc) -> list[int]:
    """Bytes of each KV group the layout describes."""
    return [math.prod(int(d) for d in shape) * dtype.itemsize
            for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True)]


def worst_case_size(group_bytes: list[int]) -> int:
    """The most an object can take: every group stored with codec ``raw`` under the largest header the format allows."""
    return frame.frame_overhead(len(group_bytes)) + sum(n + MAX_HEADER_BYTES + CHECKSUM_BYTES for n in group_bytes)


class KVCodecSerializer(Serializer):
    """Encodes each KV group of an L1 object with the serde's codec, bound to the object's key."""

    def __init__(self, codecs: CodecChoice, fixed_ratio: float | None = None) -> None:
        self._codecs = codecs
        self._fixed_ratio = fixed_ratio

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        group_bytes = raw_nbytes(layout_desc)
        if self._fixed_ratio is None:
            return worst_case_size(group_bytes)
        return math.ceil(sum(group_bytes) / self._fixed_ratio)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        blobs = [self._encode(src.get_tensor(i), group_binding(key, i)) for i in range(len(src.get_shapes()))]
        parts = frame.pack(blobs)
        written = sum(len(p) for p in parts)
        out = np.frombuffer(dst.byte_array, dtype=np.uint8)
        if written > out.size:
            raise SerdeBudgetError(
                f"{self._codecs.serde_name}: {object_name(key)} encodes to {written} bytes, over the "
                f"{out.size} of a fixed_ratio={self._fixed_ratio} object; not stored (lower fixed_ratio)"
            )
        at = 0
        for part in parts:
            out[at : at + len(part)] = np.frombuffer(part, dtype=np.uint8)
            at += len(part)
        if self._fixed_ratio is None:
            return written
        out[written:] = 0  # padding: never carry a recycled L1 buffer's old bytes (another tenant's KV) to L2
        return int(out.size)

    def _encode(self, tensor: torch.Tensor | None, binding: str) -> bytes:
        if tensor is None:
            raise ValueError(f"{self._codecs.serde_name}: source object has no tensor (invalidated)")
        codec = self._codecs.for_dtype(DType.from_torch(tensor.dtype))
        blob = encode_chunk(tensor, codec, key=binding)
        if len(blob) > tensor.numel() * tensor.element_size() + MAX_HEADER_BYTES + CHECKSUM_BYTES:
            blob = encode_chunk(tensor, "raw", key=binding)  # incompressible: keep within the worst-case estimate
        return blob


class KVCodecDeserializer(Deserializer):
    """Decodes a kvcodec frame into the destination's KV groups after checking every chunk against the key and layout.

    Any kvcodec chunk decodes, whichever kvcodec serde wrote it (each chunk names its
    codec), so a deployment that changes codec keeps reading what it stored before;
    an object some other serde (or none) wrote is refused by name (:mod:`.frame`).
    """

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        blobs = frame.unpack(src.byte_array)
        shapes, dtypes = dst.get_shapes(), dst.get_dtypes()
        if len(blobs) != len(shapes):
            raise ChunkFormatError(f"{object_name(key)}: object holds {len(blobs)} KV groups, L1 expects {len(shapes)}")
        for i, blob in enumerate(blobs):
            header = read_header(blob, key=group_binding(key, i))
            want = (DType.from_torch(dtypes[i]), tuple(int(d) for d in shapes[i]))
            if (header.dtype, header.shape) != want:
                raise ChunkFormatError(
                    f"{object_name(key)} group {i}: stored {header.dtype.name.lower()} {header.shape}, "
                    f"L1 expects {want[0].name.lower()} {want[1]}"
                )
            target = dst.get_tensor(i)
            if target is None:
                raise ValueError(f"{object_name(key)}: destination object has no tensor (invalidated)")
            target.copy_(decode_payload(blob, header, borrow=True))


def parse_fixed_ratio(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.1 <= value <= 64:
        raise ConfigError(f"fixed_ratio must be a number in [0.1, 64] (raw bytes per stored byte), got {value!r}")
    return float(value)
