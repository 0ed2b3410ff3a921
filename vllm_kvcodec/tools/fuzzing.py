"""Hostile inputs for every decoder: seeds from real KV, AFL-style mutators, one target per decoder.

Shared by the property tests (``tests/format/test_fuzz.py``, which drive the
mutators with a Hypothesis-controlled ``random.Random``) and the long run
(``python -m vllm_kvcodec.tools.bench fuzz``, which draws ``random.Random(seed, i)``
per input so any input can be rebuilt from its index).

Why more than random bytes: the XXH3 trailer rejects almost every random
mutation of a stored chunk before any parser behind it runs. So besides
mutating whole chunks (``chunk-raw``), the targets reseal mutated chunks
(``chunk-resealed``: header fields and codec config forged behind a valid
checksum) and feed each codec's ``decode`` directly with payloads of a valid
structure whose fields are then hit at their own offsets (``codec-<id>``).

A decoder passes an input when it either returns exactly the declared shape
and dtype or raises :class:`~vllm_kvcodec.errors.ChunkFormatError` (the
format's documented exception family, :class:`CodecError` included), and when
its traced allocations stay within ``ALLOC_FACTOR`` times the declared
(validated) output size plus ``ALLOC_SLACK``. The codec targets then also run
``decode_into`` on the same input (the load path's decode straight into KV
pages; ``Target.check``): it must write exactly what ``decode`` returned, or
nothing at all.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.into_pages import PageExtents
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format.container import _FIXED, decode_chunk, encode_chunk, read_header

#: traced allocations of one decode may reach ALLOC_FACTOR x declared bytes + ALLOC_SLACK
ALLOC_FACTOR = 8
#: covers fixed costs independent of the chunk: video's minimum 144 x 144 x 3 picture, tables, tracebacks
ALLOC_SLACK = 1 << 20

INTERESTING = (0, 1, 2, 3, 4, 7, 8, 15, 16, 255, 256, 4095, 4096, 0x7FFF, 0x8000, 0xFFFF, 0x10000,
               0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF)
VIDEO_BACKENDS = ("hevc", "h264", "ffv1")

#: hostile codec configs for forged headers (the nesting one once escaped as RecursionError)
HOSTILE_CONFIGS: tuple[bytes, ...] = (
    b'{"id":"raw","x":' + b"[" * 2000 + b"]" * 2000 + b"}",
    b"[" * 3000 + b"]" * 3000,
    b'{"id":"nope"}',
    b'{"id":7}',
    b'{"id":"zstd","level":99}',
    b'{"id":"zstd","level":"1"}',
    b'{"id":"rans","token_axis":7}',
    b'{"id":"rans","token_axis":-1}',
    b'{"id":"rans","token_axis":1e308}',
    b'{"id":"splitzip","extra":1}',
    b'{"id":"video","backend":"mpeg2","layout":1}',
    b'{"id":"video","backend":"hevc","layout":2}',
    b'{"id":"video","backend":"ffv1","layout":1,"threads":0}',
    b'{"id":"raw","id":"zstd"}',
    b'{"id":"\\u0000"}',
    b'{"id":"raw"',
    b"\xff\xfe",
    b"",
)


@dataclasses.dataclass(frozen=True)
class Seed:
    """A valid encoded chunk and where its fields sit (the mutators aim there half the time)."""

    codec: dict[str, Any]
    dtype: DType
    shape: tuple[int, ...]
    blob: bytes
    payload_offset: int
    payload_fields: tuple[int, ...]

    @property
    def payload(self) -> bytes:
        return self.blob[self.payload_offset : len(self.blob) - 8]

    @property
    def header_fields(self) -> tuple[int, ...]:
        ndim = len(self.shape)
        fields = [4, 6, 7, 8, 10, 12, *range(_FIXED.size, _FIXED.size + 4 * ndim, 4), _FIXED.size + 4 * ndim]
        return (*fields, self.payload_offset, *(self.payload_offset + f for f in self.payload_fields))


@dataclasses.dataclass(frozen=True)
class Case:
    """One input: the bytes, what the decoder is told, and what it may allocate."""

    data: bytes
    dtype: DType
    shape: tuple[int, ...]
    declared_nbytes: int  # validated output size (0: the header does not even parse)

    @property
    def alloc_bound(self) -> int:
        return ALLOC_FACTOR * self.declared_nbytes + ALLOC_SLACK


@dataclasses.dataclass(frozen=True)
class Target:
    """A decoder and how to make hostile inputs for it from its seeds."""

    name: str
    seeds: tuple[Seed, ...]
    make: Callable[[Seed, random.Random], Case]
    run: Callable[[Case], Any]
    #: run on the same input after the measured decode (outside its allocation trace), given what it returned
    #: (None if it raised); raises AssertionError on a finding
    check: Callable[[Case, Any], None] | None = None


# ---- seeds ------------------------------------------------------------------------------------
def seed_tensors(kv: torch.Tensor) -> list[torch.Tensor]:
    """Small real-KV tensors of every dtype and awkward shapes (odd counts, 1-D, a non-canonical rank)."""
    return [
        kv[:4, :, :32].contiguous(),  # bf16 [4, 2, 32, 3, 64], 96 KiB
        kv[:1, :, :7, :, :5].contiguous(),  # bf16, 210 elements (odd pair count)
        kv[:1, :, :8].float().contiguous(),  # fp32
        kv[:1, :, :8].half().contiguous(),  # fp16 (raw / zstd only)
        kv[0, 0, 0, 0, :63].contiguous(),  # 1-D, odd
        kv[:1, :1, :5, :3, :7].reshape(3, 5, 7).contiguous(),  # 3-D
    ]


def make_seeds(kv: torch.Tensor, configs: Sequence[dict[str, Any]]) -> list[Seed]:
    """Every (config, tensor) pair the codec supports, encoded for real."""
    seeds = []
    for config in configs:
        codec = get_codec(config)
        for t in seed_tensors(kv):
            dtype = DType.from_torch(t.dtype)
            if not codec.supports(dtype):
                continue
            if config.get("token_axis", 0) >= t.dim():
                continue
            blob = encode_chunk(t, codec)
            header = read_header(blob)
            payload = blob[header.payload_offset : len(blob) - 8]
            fields = payload_fields(codec.get_config(), payload, dtype, header.shape)
            seeds.append(Seed(codec.get_config(), dtype, header.shape, blob, header.payload_offset, fields))
    return seeds


def payload_fields(config: dict[str, Any], payload: bytes, dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Offsets of the counts, tables and stream boundaries inside a valid payload (see each codec's docstring)."""
    n = int(np.prod(shape))
    rest = 1 if dtype is DType.BFLOAT16 else 3
    cid = config["id"]
    if cid == "zstd":
        return tuple(range(18))
    if cid == "splitzip":
        m = int.from_bytes(payload[16:20], "little")
        codes = 20 + (n + 1) // 2
        return (0, 15, 16, 20, codes, codes + n * rest, codes + n * rest + 4 * m)
    if cid == "rans":
        from vllm_kvcodec.codecs.rans import channel_view

        outer, _, inner = channel_view(shape, config.get("token_axis"))
        c = outer * inner
        k = int.from_bytes(payload[c : c + 2], "little")
        w_at = c + 2 + 3 * k
        w = int.from_bytes(payload[w_at : w_at + 4], "little")
        return (0, c, c + 2, c + 5, w_at - 3, w_at, w_at + 4, w_at + 4 + 2 * w)
    if cid == "video":
        frames = int.from_bytes(payload[4:8], "little")
        sizes = 16 + n * rest
        return (0, 2, 4, 8, 16, sizes, *range(sizes, sizes + 4 * frames, 4), sizes + 4 * frames)
    return (0,)


# ---- byte mutators ------------------------------------------------------------------------------
def _offset(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> int:
    if hot and rng.random() < 0.5:
        at = rng.choice(hot) + rng.choice((0, 0, 0, 1, 2, 3, -1))
        return min(max(at, 0), max(len(buf) - 1, 0))
    return rng.randrange(len(buf)) if buf else 0


def _interesting(rng: random.Random, buf: bytearray) -> int:
    v = rng.choice((*INTERESTING, len(buf), len(buf) - 1, len(buf) + 1, rng.getrandbits(32)))
    return (v + rng.choice((0, 0, 0, 1, -1))) & 0xFFFFFFFF


def _flip_bit(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    if buf:
        buf[_offset(buf, rng, hot)] ^= 1 << rng.randrange(8)
    return buf


def _set_byte(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    if buf:
        buf[_offset(buf, rng, hot)] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    return buf


def _set_word(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    width = rng.choice((2, 4, 4, 8))
    at = _offset(buf, rng, hot)
    if at + width <= len(buf):
        value = _interesting(rng, buf) & ((1 << (8 * width)) - 1)
        buf[at : at + width] = value.to_bytes(width, "little")
    return buf


def _random_run(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    at = _offset(buf, rng, hot)
    n = min(rng.choice((1, 2, 4, 16, 256)), len(buf) - at)
    buf[at : at + n] = rng.randbytes(max(n, 0))
    return buf


def _delete_run(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    at = _offset(buf, rng, hot)
    del buf[at : at + rng.choice((1, 2, 4, 16, 1024))]
    return buf


def _insert_run(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    at = _offset(buf, rng, hot)
    n = rng.choice((1, 2, 4, 16, 1024))
    buf[at:at] = rng.randbytes(n) if rng.random() < 0.5 else bytes([rng.randrange(256)]) * n
    return buf


def _duplicate_run(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    at = _offset(buf, rng, hot)
    buf[at:at] = buf[at : at + rng.choice((4, 64, 4096))]
    return buf


def _truncate(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    return buf[: _offset(buf, rng, hot)]


def _extend(buf: bytearray, rng: random.Random, hot: Sequence[int]) -> bytearray:
    return buf + rng.randbytes(rng.choice((1, 8, 100)))


MUTATORS = (_flip_bit, _flip_bit, _set_byte, _set_word, _set_word, _set_word, _random_run,
            _delete_run, _insert_run, _duplicate_run, _truncate, _extend)


def mutate(data: bytes, rng: random.Random, hot: Sequence[int] = (), max_ops: int = 4) -> bytes:
    """1..max_ops stacked mutations, aimed at ``hot`` offsets half the time."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, max_ops)):
        buf = rng.choice(MUTATORS)(buf, rng, hot)
    return bytes(buf)


def reseal(blob: bytes) -> bytes:
    """Replace the XXH3 trailer, so the mutation reaches the parsers behind the checksum."""
    if len(blob) < 8:
        return blob
    body = blob[:-8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def with_config(blob: bytes, config: bytes) -> bytes:
    """The chunk with its codec config replaced (config_len updated), before resealing."""
    header = read_header(blob, verify=False)
    ndim = len(header.shape)
    config_at = _FIXED.size + 4 * ndim
    head = bytearray(blob[:config_at])
    head[8:10] = struct.pack("<H", len(config) & 0xFFFF)
    return bytes(head) + config + blob[header.payload_offset :]


# ---- cases ------------------------------------------------------------------------------------
def declared_nbytes(blob: bytes) -> int:
    """Output bytes the (unverified) header promises, if it parses; 0 if not."""
    try:
        return read_header(blob, verify=False).raw_nbytes
    except ChunkFormatError:
        return 0


def _chunk_case(data: bytes, seed: Seed) -> Case:
    return Case(data, seed.dtype, seed.shape, declared_nbytes(data))


def unmutated(target: Target, seed: Seed) -> Case:
    """The seed as it was encoded, in the target's form: what a warm-up runs so every kernel a decode calls is loaded."""
    if target.make is make_codec_case:
        return Case(seed.payload, seed.dtype, seed.shape, int(np.prod(seed.shape, dtype=np.int64)) * seed.dtype.itemsize)
    return _chunk_case(seed.blob, seed)


def make_chunk_raw(seed: Seed, rng: random.Random) -> Case:
    return _chunk_case(mutate(seed.blob, rng, seed.header_fields), seed)


def make_chunk_resealed(seed: Seed, rng: random.Random) -> Case:
    blob = seed.blob
    if rng.random() < 0.1:
        blob = with_config(blob, rng.choice(HOSTILE_CONFIGS))
    if rng.random() < 0.95:
        blob = mutate(blob[:-8], rng, seed.header_fields) + blob[-8:]
    return _chunk_case(reseal(blob), seed)


def make_codec_case(seed: Seed, rng: random.Random) -> Case:
    """A hostile payload, and sometimes a shape or dtype that disagrees with it."""
    dtype, shape = seed.dtype, seed.shape
    payload = seed.payload
    if rng.random() < 0.9:
        payload = mutate(payload, rng, seed.payload_fields)
    if rng.random() < 0.15:
        dims = list(shape)
        i = rng.randrange(len(dims))
        dims[i] = max(1, rng.choice((dims[i] * 2, dims[i] + 1, dims[i] - 1, 1, 0x10000)))
        shape = tuple(dims)
    if rng.random() < 0.1:
        dtype = rng.choice(sorted(get_codec(seed.codec).dtypes))
    declared = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return Case(payload, dtype, shape, declared)


def _decode_codec(config: dict[str, Any]) -> Callable[[Case], np.ndarray]:
    codec = get_codec(config)

    def run(case: Case) -> np.ndarray:
        out = codec.decode(memoryview(case.data), case.dtype, case.shape)
        if out.shape != case.shape or out.dtype != case.dtype.bits_dtype:
            raise AssertionError(f"{config['id']} decoded {out.shape}/{out.dtype}, promised {case.shape}/{case.dtype.bits_dtype}")
        return out

    return run


def _decode_into_check(config: dict[str, Any]) -> Callable[[Case, Any], None]:
    codec = get_codec(config)
    return lambda case, decoded: _check_decode_into(codec, case, decoded)


#: decode_into is checked beside decode for outputs up to this size (it writes into a buffer that large)
INTO_CHECK_BYTES = 8 << 20
_CANARY = 0xA5


def _check_decode_into(codec: Codec, case: Case, decoded: np.ndarray | None) -> None:
    """``decode_into``, given two extents of a canary-filled buffer, writes what ``decode`` returned or nothing.

    It writes through raw addresses, so it is held to more than "raises a
    format error": a payload ``decode`` refuses must leave the buffer as it
    was, and one it accepts must land exactly, with the gaps untouched.
    """
    n = case.declared_nbytes
    if not 0 < n <= INTO_CHECK_BYTES:
        return
    gap, cut = 64, n // 3 // 4 * 4
    buf = bytearray([_CANARY]) * (n + 3 * gap)
    view = memoryview(buf)
    extents = [view[gap : gap + cut], view[2 * gap + cut : 2 * gap + n]]
    try:
        wrote = codec.decode_into(memoryview(case.data), case.dtype, case.shape, PageExtents(extents))
    except ChunkFormatError:
        wrote = False
    if wrote and decoded is None:
        raise AssertionError(f"{codec.codec_id}: decode_into accepted a payload decode refuses")
    expected = bytearray([_CANARY]) * len(buf)
    if wrote:
        flat = np.ascontiguousarray(decoded).reshape(-1).view(np.uint8)
        expected[gap : gap + cut] = flat[:cut].tobytes()
        expected[2 * gap + cut : 2 * gap + n] = flat[cut:].tobytes()
    if buf != expected:
        raise AssertionError(f"{codec.codec_id}: decode_into wrote " + ("other bytes than decode returned" if wrote
                             else "into the pages although it did not decode"))


def _decode_resealed(case: Case) -> torch.Tensor:
    out = decode_chunk(case.data)
    header = read_header(case.data)  # it decoded, so the header is valid
    if tuple(out.shape) != header.shape or out.dtype != header.dtype.torch_dtype:
        raise AssertionError(f"decode_chunk returned {tuple(out.shape)}/{out.dtype}, header says {header.shape}")
    return out


CODEC_TARGETS: dict[str, dict[str, Any]] = {
    "codec-raw": {"id": "raw"},
    "codec-zstd": {"id": "zstd", "level": 1},
    "codec-splitzip": {"id": "splitzip"},
    "codec-rans": {"id": "rans"},
    "codec-rans-axis1": {"id": "rans", "token_axis": 1},
    **{f"codec-video-{b}": {"id": "video", "backend": b, "layout": 1} for b in VIDEO_BACKENDS},
}
CHUNK_TARGETS = ("chunk-raw", "chunk-resealed")


def target_names(video: bool = True) -> list[str]:
    return [*CHUNK_TARGETS, *(n for n in CODEC_TARGETS if video or "video" not in n)]


def make_target(name: str, kv: torch.Tensor, video: bool = True) -> Target:
    """One target; chunk targets mutate chunks of every codec, codec targets one codec's payloads."""
    if name in CODEC_TARGETS:
        config = CODEC_TARGETS[name]
        return Target(name, tuple(make_seeds(kv, [config])), make_codec_case, _decode_codec(config),
                      _decode_into_check(config))
    if name not in CHUNK_TARGETS:
        raise ValueError(f"unknown fuzz target {name!r}; known: {', '.join(target_names())}")
    configs = [c for n, c in CODEC_TARGETS.items() if video or "video" not in n]
    seeds = tuple(s for s in make_seeds(kv, configs) if s.codec["id"] != "video" or s.dtype is DType.BFLOAT16)
    if name == "chunk-resealed":
        return Target(name, seeds, make_chunk_resealed, _decode_resealed)
    originals = {s.blob for s in seeds}

    def decode_raw_mutation(case: Case) -> torch.Tensor:
        out = decode_chunk(case.data)
        if case.data not in originals:  # only an unmodified chunk may pass its checksum
            raise AssertionError("a mutated chunk passed its XXH3 checksum")
        return out

    return Target(name, seeds, make_chunk_raw, decode_raw_mutation)


def is_format_error(exc: BaseException) -> bool:
    """The documented outcome of a bad input: the format's own exception family."""
    return isinstance(exc, ChunkFormatError)

