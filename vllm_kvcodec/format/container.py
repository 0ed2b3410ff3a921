"""The chunk container: one self-describing, checksummed blob per stored KV chunk.

Byte-level spec in ``docs/format.md``. A reader needs nothing but the blob: the
header names the codec and its parameters, the dtype and the shape, and the
trailer is an XXH3-64 over everything before it. A chunk may be bound to the
store key it was written under (flag ``KEY_BOUND``: an XXH3-64 digest of the
key in the header), so a reader that knows which key it asked for can tell a
swapped or misplaced object, which a checksum alone cannot: it is intact, just
not the chunk that was asked for. A chunk may also record the token ids it
was computed from (flag ``TOKEN_DIGESTS``: a chained digest per few tokens,
see :mod:`vllm_kvcodec.keys.token_digests`), so a reader can check that an object
holds *its prompt's* KV before a byte reaches paged memory, whatever key or
ref led to it. And it may carry a digest of its decoded values (flag
``VALUE_DIGEST``: a segmented XXH3-64 whose segments a device hashes in
parallel, see :func:`value_digest`), which a decoder checks after decoding:
it vouches for the values a decoder produced (NVDEC, say), not for the
stored bytes, which the trailer covers. Decoding validates each field
and size before it allocates, and raises :class:`ChunkFormatError` (or a
subclass) on anything it cannot vouch for, so it never returns wrong data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from vllm_kvcodec.codecs import get_codec, policy
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.dtypes import DType, bits_to_tensor, tensor_to_bits
from vllm_kvcodec.codecs.precision import Precision
from vllm_kvcodec.errors import ChunkFormatError, ConfigError, KVCodecError

if TYPE_CHECKING:
    from vllm_kvcodec.codecs.into_pages import PageExtents

MAGIC = b"KVCZ"
VERSION = 1
MAX_NDIM = 8
MAX_CONFIG_BYTES = 4096
# 2**31 elements (4 GiB of bf16) per chunk: far above any sane chunk, far below what breaks int math.
MAX_ELEMENTS = 1 << 31

_FIXED = struct.Struct("<4sHBBHHQ")  # magic, version, dtype, ndim, config_len, flags, payload_len
_CHECKSUM = struct.Struct("<Q")
_KEY_DIGEST = struct.Struct("<Q")
_VALUE_DIGEST = struct.Struct("<IQ")  # segment bytes, digest
#: Header flag: the key digest (XXH3-64 of the store key's ASCII bytes) follows the shape.
KEY_BOUND = 0x1
#: Header flag: token digests follow the key digest: tokens per digest and count (u16 each), then the digests.
TOKEN_DIGESTS = 0x2
#: Header flag: a digest of the decoded values (segment size, segmented XXH3-64) follows the token digests.
VALUE_DIGEST = 0x4
_KNOWN_FLAGS = KEY_BOUND | TOKEN_DIGESTS | VALUE_DIGEST
#: Value digest segments: a power of two in this range (bytes).
MIN_DIGEST_SEGMENT, MAX_DIGEST_SEGMENT = 1 << 10, 1 << 30
#: XXH3 hashes inputs up to this length without its accumulator loop; a last segment this short joins the one before.
DIGEST_SHORT_TAIL = 240
_DIGESTS_HEAD = struct.Struct("<HH")
#: Bytes of each token digest (a truncated SHA-256 or XXH3-128, see keys/token_digests.py).
TOKEN_DIGEST_BYTES = 16
#: Token digests one header may hold: 16 KiB of them, a 16k-token object at 16 tokens per digest.
MAX_TOKEN_DIGESTS = 1024
MIN_CHUNK_BYTES = _FIXED.size + _CHECKSUM.size
#: The fixed part of every chunk header (:func:`header_length` needs it, and the token digests' count if flagged).
FIXED_HEADER_BYTES = _FIXED.size
#: The longest header this format allows: the fixed part, MAX_NDIM dimensions, a key digest, the most token
#: digests, a value digest, the largest codec config.
MAX_HEADER_BYTES = (_FIXED.size + 4 * MAX_NDIM + _KEY_DIGEST.size + _DIGESTS_HEAD.size
                    + MAX_TOKEN_DIGESTS * TOKEN_DIGEST_BYTES + _VALUE_DIGEST.size + MAX_CONFIG_BYTES)
#: The trailer: XXH3-64 (seed 0) of every byte before it.
CHECKSUM_BYTES = _CHECKSUM.size


@dataclasses.dataclass(frozen=True)
class TokenDigests:
    """One digest of ``TOKEN_DIGEST_BYTES`` per ``unit`` tokens of an object, in token order."""

    unit: int
    digests: bytes

    def __post_init__(self) -> None:
        count, rest = divmod(len(self.digests), TOKEN_DIGEST_BYTES)
        if rest or not 1 <= count <= MAX_TOKEN_DIGESTS or not 1 <= self.unit <= 0xFFFF:
            raise ChunkFormatError(f"token digests of {len(self.digests)} bytes at {self.unit} tokens each are not "
                                   f"1 to {MAX_TOKEN_DIGESTS} digests of {TOKEN_DIGEST_BYTES} bytes")

    @property
    def count(self) -> int:
        return len(self.digests) // TOKEN_DIGEST_BYTES

    def pack(self) -> bytes:
        return _DIGESTS_HEAD.pack(self.unit, self.count) + self.digests


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    """What a chunk says about itself; ``payload_offset`` locates the codec payload."""

    version: int
    dtype: DType
    shape: tuple[int, ...]
    codec_config: dict[str, Any]
    payload_offset: int
    payload_length: int
    key_digest: int | None = None  # XXH3-64 of the key the chunk is bound to, None if unbound
    tokens: TokenDigests | None = None  # what the chunk records of its token ids, None if nothing
    value_digest: ValueDigest | None = None  # what the decoded values must hash to (flag VALUE_DIGEST)

    @property
    def codec_id(self) -> str:
        return str(self.codec_config["id"])

    @property
    def raw_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: exact at any size


@dataclasses.dataclass(frozen=True)
class ValueDigest:
    """A chunk's digest of its decoded values: :func:`value_digest` of their bytes with ``segment``-byte segments."""

    segment: int
    digest: int


def digest_segments(nbytes: int, segment: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each segment of ``nbytes`` bytes: ``segment`` bytes each, the last one holding the rest,
    joined to the one before when it would be :data:`DIGEST_SHORT_TAIL` bytes or fewer (so every segment of a
    multi-segment digest takes XXH3's long-input path, which a device kernel computes)."""
    count = max(1, -(-nbytes // segment))
    if count > 1 and nbytes - (count - 1) * segment <= DIGEST_SHORT_TAIL:
        count -= 1
    return [(i * segment, nbytes if i == count - 1 else (i + 1) * segment) for i in range(count)]


def value_digest(data: bytes | bytearray | memoryview | np.ndarray, segment: int) -> int:
    """XXH3-64 (seed 0) of the little-endian u64 XXH3-64 digests of ``data``'s segments (:func:`digest_segments`).

    Segments are independent, so a device hashes them in parallel (one
    program each) and the host hashes the short list of their digests.
    """
    _check_segment(segment)
    view = memoryview(data).cast("B")
    digests = [xxhash.xxh3_64_intdigest(view[a:b]) for a, b in digest_segments(len(view), segment)]
    return xxhash.xxh3_64_intdigest(np.array(digests, dtype="<u8").tobytes())


def _check_segment(segment: int) -> None:
    if not MIN_DIGEST_SEGMENT <= segment <= MAX_DIGEST_SEGMENT or segment & (segment - 1):
        raise ChunkFormatError(f"value digest segment of {segment} bytes is not a power of two in "
                               f"[{MIN_DIGEST_SEGMENT}, {MAX_DIGEST_SEGMENT}]")


def verify_value_digest(bits: np.ndarray, header: ChunkHeader) -> None:
    """Raise :class:`ChunkFormatError` unless ``bits`` (the decoded elements) match the header's value digest."""
    if header.value_digest is None:
        return
    if value_digest(_le_bytes(bits), header.value_digest.segment) != header.value_digest.digest:
        raise ChunkFormatError("value digest mismatch: the payload decoded to other values than were encoded")


def key_digest(key: str) -> int:
    """What a key-bound chunk stores of its key: XXH3-64 (seed 0) of the key's ASCII bytes."""
    return xxhash.xxh3_64_intdigest(key.encode("ascii"))


def encode_chunk(
    kv: torch.Tensor, codec: str | dict[str, Any] | Codec | None = None, *, key: str | None = None,
    tokens: TokenDigests | None = None, value_digest_segment: int | None = None,
    precision: str | Precision | None = None, **params: Any,
) -> bytes:
    """Encode one KV chunk (any shape, bf16/fp16/fp32) into a self-describing blob.

    ``codec=None`` picks the codec policy's default for the tensor's dtype (:mod:`.codecs.policy`).
    ``precision``: ``lossless`` (None, the default: bit-exact) or a lossy level (``int8``, ``int6``, ``int4``;
    LOSSY: NOT BIT-EXACT) for a canonical ``[layers, 2, tokens, heads, dim]`` chunk; ``codec`` then names what
    codes the integers (``rans``), and :func:`decode_chunk` returns the dequantised values in the source dtype
    (:mod:`~vllm_kvcodec.codecs.quantized`). ``key``
    binds the chunk to the store key it will be written under (see
    :func:`read_header`); ``tokens`` records the token ids it was computed from. ``value_digest_segment``: write
    a digest of the values with segments of that many bytes (``0``: none); by default the codec's
    ``value_digest_segment`` (a codec whose decoder may return other values than were encoded without noticing,
    such as a hardware video decoder, sets one).
    """
    bits, dtype = tensor_to_bits(kv)
    coder = policy.precision_codec(precision, codec) or policy.lossless_codec(
        get_codec(codec if codec is not None else policy.default_codec_for(dtype), **params))
    coder.check_dtype(dtype)
    _check_shape(tuple(bits.shape))
    segment = getattr(coder, "value_digest_segment", 0) if value_digest_segment is None else value_digest_segment
    digest = ValueDigest(segment, value_digest(_le_bytes(bits), segment)) if segment else None
    return build_chunk(coder.encode(bits, dtype), dtype, tuple(bits.shape), coder.get_config(), key=key,
                       tokens=tokens, value_digest=digest)


def _le_bytes(bits: np.ndarray) -> np.ndarray:
    """The elements' bytes, little-endian (what a device holds after decoding)."""
    flat = np.ascontiguousarray(bits).reshape(-1)
    if sys.byteorder != "little":
        flat = flat.astype(flat.dtype.newbyteorder("<"))
    return flat.view(np.uint8)


def build_chunk(
    payload: bytes | memoryview, dtype: DType, shape: tuple[int, ...], codec_config: dict[str, Any],
    *, key: str | None = None, tokens: TokenDigests | None = None, value_digest: ValueDigest | None = None,
) -> bytes:
    """Wrap a codec payload made elsewhere (a GPU encoder, say) in header and checksum (and ``value_digest``)."""
    _check_shape(shape)
    config = _dump_config(codec_config)
    payload = memoryview(payload).cast("B")
    flags = ((KEY_BOUND if key is not None else 0) | (TOKEN_DIGESTS if tokens is not None else 0)
             | (VALUE_DIGEST if value_digest is not None else 0))
    if value_digest is not None:
        _check_segment(value_digest.segment)
    head = b"".join((
        _FIXED.pack(MAGIC, VERSION, int(dtype), len(shape), len(config), flags, len(payload)),
        struct.pack(f"<{len(shape)}I", *shape),
        _KEY_DIGEST.pack(key_digest(key)) if key is not None else b"",
        tokens.pack() if tokens is not None else b"",
        _VALUE_DIGEST.pack(value_digest.segment, value_digest.digest) if value_digest is not None else b"",
        config,
    ))
    digest = xxhash.xxh3_64(head)
    digest.update(payload)
    return b"".join((head, payload, _CHECKSUM.pack(digest.intdigest())))  # the payload is copied once


def read_header(blob: bytes | bytearray | memoryview, verify: bool = True, key: str | None = None) -> ChunkHeader:
    """Parse and validate a chunk's header (and, by default, its checksum) without decoding.

    With ``key``, the chunk must also be bound to that key: an unbound chunk, or
    one bound to another key (a swapped object), is rejected.
    """
    buf = memoryview(blob).cast("B")
    if len(buf) < MIN_CHUNK_BYTES:
        raise ChunkFormatError(f"blob of {len(buf)} bytes is shorter than any chunk ({MIN_CHUNK_BYTES})")
    _fixed_fields(buf)  # magic and version before the checksum: a foreign blob is named as such
    if verify:
        verify_checksum(buf)
    return parse_header(buf, len(buf), key)


def header_length(head: bytes | bytearray | memoryview) -> int:
    """How many bytes precede the payload, from a chunk's first bytes (validated, bounded).

    For readers that fetch a chunk in parts (:mod:`storage.ranged`): read
    :data:`MAX_HEADER_BYTES` (or the whole chunk, if shorter), then this many
    bytes are the header: :func:`parse_header` them, then decide where the
    payload goes. The fixed part is enough unless the chunk has token digests,
    whose count follows the shape and key digest.
    """
    buf = memoryview(head).cast("B")
    _, _, _, ndim, config_len, flags, _ = _fixed_fields(buf)
    _check_header_fields(ndim, config_len, flags)
    return _sections(buf, ndim, flags)[3] + config_len


def parse_header(head: bytes | bytearray | memoryview, total: int, key: str | None = None) -> ChunkHeader:
    """Validate the header at the start of ``head`` for a chunk of ``total`` bytes (its checksum is not verified).

    ``head`` may be the whole chunk or only its first :func:`header_length`
    bytes; every size is checked against ``total``, so a reader can place the
    payload before it has read it.
    """
    buf = memoryview(head).cast("B")
    if total < MIN_CHUNK_BYTES:
        raise ChunkFormatError(f"blob of {total} bytes is shorter than any chunk ({MIN_CHUNK_BYTES})")
    _, _, dtype_code, ndim, config_len, flags, payload_len = _fixed_fields(buf)
    _check_header_fields(ndim, config_len, flags)
    dtype = DType.from_wire(dtype_code)
    shape_at = _FIXED.size
    digest_at, tokens, value_at, config_at = _sections(buf, ndim, flags)
    payload_at = config_at + config_len
    if payload_at + payload_len + _CHECKSUM.size != total:
        raise ChunkFormatError(
            f"sizes disagree: header says {payload_at + payload_len + _CHECKSUM.size} bytes, blob has {total}"
        )
    if len(buf) < payload_at:
        raise ChunkFormatError(f"header of {payload_at} bytes, only {len(buf)} given")
    shape = struct.unpack_from(f"<{ndim}I", buf, shape_at)
    _check_shape(shape)
    bound = _KEY_DIGEST.unpack_from(buf, digest_at)[0] if flags & KEY_BOUND else None
    if key is not None:
        _check_binding(bound, key)
    values = None
    if flags & VALUE_DIGEST:
        values = ValueDigest(*_VALUE_DIGEST.unpack_from(buf, value_at))
        _check_segment(values.segment)
    config = _load_config(buf[config_at:payload_at])
    return ChunkHeader(VERSION, dtype, shape, config, payload_at, payload_len, bound, tokens, values)


def _sections(buf: memoryview, ndim: int, flags: int) -> tuple[int, TokenDigests | None, int, int]:
    """The optional sections between the shape and the codec config, in flag order: where the key digest starts,
    the token digests (validated), where the value digest starts, and where the codec config starts."""
    digest_at = _FIXED.size + 4 * ndim
    tokens_at = digest_at + (_KEY_DIGEST.size if flags & KEY_BOUND else 0)
    if not flags & TOKEN_DIGESTS:
        return digest_at, None, tokens_at, tokens_at + (_VALUE_DIGEST.size if flags & VALUE_DIGEST else 0)
    if len(buf) < tokens_at + _DIGESTS_HEAD.size:
        raise ChunkFormatError(f"header of at least {tokens_at + _DIGESTS_HEAD.size} bytes, only {len(buf)} given")
    unit, count = _DIGESTS_HEAD.unpack_from(buf, tokens_at)
    if not 1 <= count <= MAX_TOKEN_DIGESTS:
        raise ChunkFormatError(f"{count} token digests, not 1 to {MAX_TOKEN_DIGESTS}")
    at = tokens_at + _DIGESTS_HEAD.size
    end = at + count * TOKEN_DIGEST_BYTES
    if len(buf) < end:
        raise ChunkFormatError(f"header of at least {end} bytes, only {len(buf)} given")
    return digest_at, TokenDigests(unit, bytes(buf[at:end])), end, end + (_VALUE_DIGEST.size if flags & VALUE_DIGEST else 0)


def _fixed_fields(buf: memoryview) -> tuple[Any, ...]:
    if len(buf) < _FIXED.size:
        raise ChunkFormatError(f"{len(buf)} bytes hold no chunk header ({_FIXED.size})")
    fields = _FIXED.unpack_from(buf)
    if fields[0] != MAGIC:
        raise ChunkFormatError(f"bad magic {bytes(fields[0])!r}: not a vllm-kvcodec chunk")
    if fields[1] != VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {fields[1]} (this reader knows {VERSION})")
    return fields


def _check_header_fields(ndim: int, config_len: int, flags: int) -> None:
    if flags & ~_KNOWN_FLAGS:
        raise ChunkFormatError(f"unknown header flags {flags:#x}")
    if not 1 <= ndim <= MAX_NDIM:
        raise ChunkFormatError(f"ndim {ndim} outside [1, {MAX_NDIM}]")
    if config_len > MAX_CONFIG_BYTES:
        raise ChunkFormatError(f"codec config of {config_len} bytes exceeds {MAX_CONFIG_BYTES}")


def _check_binding(bound: int | None, key: str) -> None:
    if bound is None:
        raise ChunkFormatError(f"chunk under {key} is not bound to a key; a reader that asks for a key needs one that is")
    if bound != key_digest(key):
        raise ChunkFormatError(f"chunk under {key} was written for another key (a swapped or misplaced object)")


def verify_checksum(blob: bytes | bytearray | memoryview) -> None:
    buf = memoryview(blob).cast("B")
    if len(buf) < MIN_CHUNK_BYTES:
        raise ChunkFormatError(f"blob of {len(buf)} bytes is shorter than any chunk ({MIN_CHUNK_BYTES})")
    (stored,) = _CHECKSUM.unpack_from(buf, len(buf) - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(buf[: len(buf) - _CHECKSUM.size]) != stored:
        raise ChunkFormatError("checksum mismatch: the chunk is corrupted")


def decode_chunk(blob: bytes | bytearray | memoryview, key: str | None = None) -> torch.Tensor:
    """Decode a blob made by :func:`encode_chunk` into a new CPU tensor, bit-exact.

    ``key``: the store key the blob was read from; the chunk must be bound to it.
    """
    return decode_payload(blob, read_header(blob, key=key))


def decode_payload(blob: bytes | bytearray | memoryview, header: ChunkHeader, *, borrow: bool = False) -> torch.Tensor:
    """Decode ``blob``'s payload, given the header :func:`read_header` validated for it (not parsed again).

    ``borrow``: the tensor may share memory with ``blob`` (see :meth:`Codec.decode_borrowed`); for a
    caller that copies it somewhere at once and never writes it.
    """
    codec = codec_for(header)
    payload = payload_of(blob, header)
    decode = codec.decode_borrowed if borrow else codec.decode
    bits = decode(payload, header.dtype, header.shape)
    if bits.shape != header.shape or bits.dtype != header.dtype.bits_dtype:
        raise ChunkFormatError(f"codec {header.codec_id!r} produced {bits.shape}/{bits.dtype}, not {header.shape}")
    verify_value_digest(bits, header)
    return bits_to_tensor(bits, header.dtype)


def payload_of(blob: bytes | bytearray | memoryview, header: ChunkHeader) -> memoryview:
    """The codec payload of ``blob``, whose header :func:`read_header` validated, without a copy."""
    return memoryview(blob).cast("B")[header.payload_offset : header.payload_offset + header.payload_length]


def decode_payload_into(blob: bytes | bytearray | memoryview, header: ChunkHeader, extents: PageExtents) -> bool:
    """:func:`decode_payload` straight into ``extents`` (the object's pages, in order), where its codec can.

    False, having written nothing, where it cannot: decode and copy instead.
    """
    if sys.byteorder != "little":  # the kernels write the values' bytes as this host orders them
        return False
    if header.value_digest is not None:  # checked on the decoded values: decode, check, then copy
        return False
    payload = payload_of(blob, header)
    return codec_for(header).decode_into(payload, header.dtype, header.shape, extents)


def codec_for(header: ChunkHeader) -> Codec:
    """The codec that decodes ``header``'s payload (a device decoder asks too), its config exactly as encoders write it."""
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
    if math.prod(shape) > MAX_ELEMENTS:
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
    "CHECKSUM_BYTES", "ChunkFormatError", "ChunkHeader", "FIXED_HEADER_BYTES", "KEY_BOUND", "KVCodecError", "MAGIC",
    "MAX_HEADER_BYTES", "MAX_TOKEN_DIGESTS", "TOKEN_DIGESTS", "TOKEN_DIGEST_BYTES", "TokenDigests", "VALUE_DIGEST",
    "VERSION", "ValueDigest", "build_chunk", "codec_for", "decode_chunk", "decode_payload", "decode_payload_into",
    "digest_segments", "encode_chunk", "header_length", "key_digest", "parse_header", "payload_of", "read_header", "value_digest",
    "verify_checksum", "verify_value_digest",
]
