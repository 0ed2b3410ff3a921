"""The chunk container: one self-describing, checksummed blob per stored KV chunk.

Byte-level spec in ``docs/format.md``. A reader needs nothing but the blob: the
header names the codec and its parameters, the dtype and the shape, and the
trailer is an XXH3-64 over everything before it. Decoding validates each field
and size before it allocates, and raises :class:`ChunkFormatError` (or a
subclass) on anything it cannot vouch for, so it never returns wrong data.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np
import torch
import xxhash

from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.dtypes import DType, bits_to_tensor, tensor_to_bits
from vllm_kvcodec.errors import ChunkFormatError, ConfigError, KVCodecError

MAGIC = b"KVCZ"
VERSION = 1
MAX_NDIM = 8
MAX_CONFIG_BYTES = 4096
# 2**31 elements (4 GiB of bf16) per chunk: far above any sane chunk, far below what breaks int math.
MAX_ELEMENTS = 1 << 31
DEFAULT_CODEC = "rans"  # the densest bit-exact codec; float16 falls back to FALLBACK_CODEC
FALLBACK_CODEC = "zstd"

_FIXED = struct.Struct("<4sHBBHHQ")  # magic, version, dtype, ndim, config_len, flags, payload_len
_CHECKSUM = struct.Struct("<Q")
MIN_CHUNK_BYTES = _FIXED.size + _CHECKSUM.size


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    """What a chunk says about itself; ``payload_offset`` locates the codec payload."""

    version: int
    dtype: DType
    shape: tuple[int, ...]
    codec_config: dict[str, Any]
    payload_offset: int
    payload_length: int

    @property
    def codec_id(self) -> str:
        return str(self.codec_config["id"])

    @property
    def raw_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def default_codec_for(dtype: DType) -> str:
    """The best lossless codec that can represent ``dtype``."""
    return DEFAULT_CODEC if get_codec(DEFAULT_CODEC).supports(dtype) else FALLBACK_CODEC


def encode_chunk(kv: torch.Tensor, codec: str | dict[str, Any] | Codec | None = None, **params: Any) -> bytes:
    """Encode one KV chunk (any shape, bf16/fp16/fp32) into a self-describing blob.

    ``codec=None`` picks :func:`default_codec_for` the tensor's dtype.
    """
    bits, dtype = tensor_to_bits(kv)
    coder = get_codec(codec if codec is not None else default_codec_for(dtype), **params)
    coder.check_dtype(dtype)
    _check_shape(tuple(bits.shape))
    return build_chunk(coder.encode(bits, dtype), dtype, tuple(bits.shape), coder.get_config())


def build_chunk(payload: bytes | memoryview, dtype: DType, shape: tuple[int, ...], codec_config: dict[str, Any]) -> bytes:
    """Wrap a codec payload made elsewhere (a GPU encoder, say) in header and checksum."""
    _check_shape(shape)
    config = _dump_config(codec_config)
    payload = memoryview(payload).cast("B")
    head = b"".join((
        _FIXED.pack(MAGIC, VERSION, int(dtype), len(shape), len(config), 0, len(payload)),
        struct.pack(f"<{len(shape)}I", *shape),
        config,
    ))
    digest = xxhash.xxh3_64(head)
    digest.update(payload)
    return b"".join((head, payload, _CHECKSUM.pack(digest.intdigest())))  # the payload is copied once


def read_header(blob: bytes | bytearray | memoryview, verify: bool = True) -> ChunkHeader:
    """Parse and validate a chunk's header (and, by default, its checksum) without decoding."""
    buf = memoryview(blob).cast("B")
    if len(buf) < MIN_CHUNK_BYTES:
        raise ChunkFormatError(f"blob of {len(buf)} bytes is shorter than any chunk ({MIN_CHUNK_BYTES})")
    magic, version, dtype_code, ndim, config_len, flags, payload_len = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise ChunkFormatError(f"bad magic {bytes(magic)!r}: not a vllm-kvcodec chunk")
    if version != VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {version} (this reader knows {VERSION})")
    if verify:
        verify_checksum(buf)
    if flags != 0:
        raise ChunkFormatError(f"unknown header flags {flags:#x}")
    dtype = DType.from_wire(dtype_code)
    if not 1 <= ndim <= MAX_NDIM:
        raise ChunkFormatError(f"ndim {ndim} outside [1, {MAX_NDIM}]")
    if config_len > MAX_CONFIG_BYTES:
        raise ChunkFormatError(f"codec config of {config_len} bytes exceeds {MAX_CONFIG_BYTES}")
    shape_at = _FIXED.size
    config_at = shape_at + 4 * ndim
    payload_at = config_at + config_len
    if payload_at + payload_len + _CHECKSUM.size != len(buf):
        raise ChunkFormatError(
            f"sizes disagree: header says {payload_at + payload_len + _CHECKSUM.size} bytes, blob has {len(buf)}"
        )
    shape = struct.unpack_from(f"<{ndim}I", buf, shape_at)
    _check_shape(shape)
    config = _load_config(buf[config_at:payload_at])
    return ChunkHeader(version, dtype, shape, config, payload_at, payload_len)


def verify_checksum(blob: bytes | bytearray | memoryview) -> None:
    buf = memoryview(blob).cast("B")
    if len(buf) < MIN_CHUNK_BYTES:
        raise ChunkFormatError(f"blob of {len(buf)} bytes is shorter than any chunk ({MIN_CHUNK_BYTES})")
    (stored,) = _CHECKSUM.unpack_from(buf, len(buf) - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(buf[: len(buf) - _CHECKSUM.size]) != stored:
        raise ChunkFormatError("checksum mismatch: the chunk is corrupted")


def decode_chunk(blob: bytes | bytearray | memoryview) -> torch.Tensor:
    """Decode a blob made by :func:`encode_chunk` into a new CPU tensor, bit-exact."""
    header = read_header(blob)
    codec = _codec_for(header)
    payload = memoryview(blob).cast("B")[header.payload_offset : header.payload_offset + header.payload_length]
    bits = codec.decode(payload, header.dtype, header.shape)
    if bits.shape != header.shape or bits.dtype != header.dtype.bits_dtype:
        raise ChunkFormatError(f"codec {header.codec_id!r} produced {bits.shape}/{bits.dtype}, not {header.shape}")
    return bits_to_tensor(bits, header.dtype)


def _codec_for(header: ChunkHeader) -> Codec:
    try:
        codec = get_codec(header.codec_config)
    except ConfigError as exc:
        raise ChunkFormatError(f"chunk names a codec this reader cannot build: {exc}") from None
    if codec.get_config() != header.codec_config:
        # Encoders write exactly get_config(); anything more (say, an encoder's thread
        # count) is a forged setting that would steer this decoder's resources.
        raise ChunkFormatError(f"codec config {header.codec_config} is not one an encoder writes")
    if not codec.supports(header.dtype):
        raise ChunkFormatError(f"codec {header.codec_id!r} does not support {header.dtype.name.lower()}")
    return codec


def _check_shape(shape: tuple[int, ...]) -> None:
    if not 1 <= len(shape) <= MAX_NDIM:
        raise ChunkFormatError(f"ndim {len(shape)} outside [1, {MAX_NDIM}]")
    if any(d < 1 or d > 0xFFFFFFFF for d in shape):
        raise ChunkFormatError(f"shape {tuple(shape)} has an empty or oversized dimension")
    if int(np.prod(shape, dtype=np.float64)) > MAX_ELEMENTS:
        raise ChunkFormatError(f"shape {tuple(shape)} exceeds {MAX_ELEMENTS} elements")


def _dump_config(config: dict[str, Any]) -> bytes:
    raw = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"codec config of {len(raw)} bytes exceeds {MAX_CONFIG_BYTES}")
    return raw


def _load_config(raw: memoryview) -> dict[str, Any]:
    try:
        config = json.loads(bytes(raw).decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: hostile nesting depth
        raise ChunkFormatError("codec config is not ASCII JSON") from None
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise ChunkFormatError("codec config must be a JSON object with a string 'id'")
    return config


__all__ = [
    "ChunkFormatError", "ChunkHeader", "DEFAULT_CODEC", "KVCodecError", "MAGIC", "VERSION",
    "build_chunk", "decode_chunk", "encode_chunk", "read_header", "verify_checksum",
]
