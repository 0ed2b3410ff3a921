"""``rans``: per-channel exponent residuals, rANS-coded; sign+mantissa stored raw.

The densest bit-exact codec here, for slow links. It takes the two lessons of
our measurements on real KV (docs/codecs.md): split the exponent from the
sign+mantissa bits (the latter are incompressible), and condition the exponent
on its channel (order-0 exponent entropy 2.95 bits; given the channel, 2.47).
A chunk stores each channel's median exponent; the residuals
``(exponent - median) mod 256`` of all channels share one frequency table and
are coded with a static rANS (:mod:`.rans_kernels`). Measured 1.51x on
SmolLM2 KV, above the order-0 bound (1.467x) that SplitZip and zstd are held
to.

Channels: the tensor is viewed as ``[outer, tokens, inner]``; a channel is
one ``(outer, inner)`` pair. The token axis is the ``token_axis`` parameter
(stored in the chunk's codec config when given); by default axis 2, as in the
canonical ``[layers, 2, tokens, heads, dim]`` and LMCache's ``[2, layers,
tokens, hidden]``, or axis 0 for tensors of fewer than 3 dims.

Payload (little-endian; ``C`` channels, ``n`` elements, ``r`` sign+mantissa
bytes per element: 1 for bfloat16, 3 for float32)::

    medians   C x u8          per-channel median exponent
    k         u16             number of symbols with a nonzero frequency (1..256)
    table     k x (u8, u16)   (symbol, frequency), symbols strictly increasing, sum 4096
    w         u32             number of 16-bit words
    words     w x u16         4 rANS states (low half first), then renormalisation words
    signman   n*r x u8        as in splitzip

float16 has no whole-byte exponent split and is refused (use ``zstd`` or ``raw``).
"""

from __future__ import annotations

import vllm_kvcodec.codecs.numba_compat  # noqa: F401  (before numba; see its docstring)
import numba
import numpy as np

from vllm_kvcodec.codecs import rans_kernels as rk
from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.into_pages import PageExtents, merge_into
from vllm_kvcodec.codecs.planes import merge, split
from vllm_kvcodec.codecs.registry import register_codec
from vllm_kvcodec.codecs.validate import Reader, expect_at_most
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import CodecError, ConfigError


@register_codec
class RansCodec(Codec):
    codec_id = "rans"
    dtypes = frozenset({DType.BFLOAT16, DType.FLOAT32})

    def __init__(self, token_axis: int | None = None) -> None:
        if token_axis is not None and (not isinstance(token_axis, int) or not 0 <= token_axis < 8):
            raise ConfigError(f"rans token_axis must be an integer in [0, 8), got {token_axis!r}")
        self.token_axis = token_axis

    def get_config(self) -> dict:
        config = super().get_config()
        if self.token_axis is not None:
            config["token_axis"] = self.token_axis
        return config

    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        exps, signman = split(np.ascontiguousarray(bits).reshape(-1), dtype)
        exps3 = exps.reshape(channel_view(bits.shape, self.token_axis))
        medians = channel_medians(exps3)
        symbols = shift_channels(exps3, medians, -1).reshape(-1)
        return b"".join((medians.tobytes(), encode_plane(symbols), signman.tobytes()))

    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        exps, signman = self._planes(payload, dtype, shape)
        return merge(exps, signman, dtype).reshape(shape)

    def decode_into(self, payload: memoryview, dtype: DType, shape: tuple[int, ...], extents: PageExtents) -> bool:
        n = int(np.prod(shape, dtype=np.int64))
        if dtype is not DType.BFLOAT16 or not extents.holds(2 * n, 2):
            return False
        exps, signman = self._planes(payload, dtype, shape)
        return merge_into(exps, signman, dtype, extents)

    def _planes(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The exponents (decoded, flat) and the sign-mantissa bytes, every size checked first."""
        outer, tokens, inner = channel_view(shape, self.token_axis)
        n = outer * tokens * inner
        reader = Reader(payload, "rans payload")
        medians = np.frombuffer(reader.take(outer * inner, "medians"), dtype=np.uint8)
        symbols = read_plane(reader, n)
        signman = np.frombuffer(reader.take(n * _rest_bytes(dtype), "sign-mantissa"), dtype=np.uint8)
        reader.finish()
        exps = shift_channels(symbols.reshape(outer, tokens, inner), medians.reshape(outer, inner), 1)
        return exps.reshape(-1), signman


def encode_plane(symbols: np.ndarray) -> bytes:
    """One plane of byte symbols, order-0 rANS-coded under its own frequency table: ``k``, the table, ``w``, the
    words (the layout in the module docstring)."""
    freqs = rk.quantize_frequencies(np.bincount(symbols, minlength=256))
    present = np.flatnonzero(freqs)
    table = np.empty(present.size, dtype=[("s", "u1"), ("f", "<u2")])
    table["s"], table["f"] = present, freqs[present]
    words = rk.encode_symbols(symbols, freqs).astype("<u2")
    return b"".join((np.uint16(present.size).tobytes(), table.tobytes(), np.uint32(words.size).tobytes(),
                     words.tobytes()))


def read_plane(reader: Reader, n: int) -> np.ndarray:
    """The ``n`` byte symbols of a plane :func:`encode_plane` wrote, every size checked before it is allocated."""
    freqs = _read_table(reader)
    n_words = reader.u32("word count")
    expect_at_most("rans word count", n_words, 2 * rk.LANES + n)
    words = np.frombuffer(reader.take(2 * n_words, "words"), dtype="<u2")
    words = words if words.dtype.isnative else words.astype(np.uint16)  # read in place on little-endian hosts
    symbols = np.empty(n, dtype=np.uint8)
    if not rk.decode(words, freqs, symbols):
        raise CodecError("rans stream is inconsistent (truncated, padded or corrupted)")
    return symbols


def channel_view(shape: tuple[int, ...], token_axis: int | None = None) -> tuple[int, int, int]:
    """``[outer, tokens, inner]`` for a shape (see the module docstring)."""
    axis = token_axis if token_axis is not None else (2 if len(shape) >= 3 else 0)
    if axis >= len(shape):
        raise CodecError(f"rans token_axis {axis} does not exist in a {len(shape)}-D chunk")
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    return outer, int(shape[axis]), inner


def _rest_bytes(dtype: DType) -> int:
    return 1 if dtype is DType.BFLOAT16 else 3


def _read_table(reader: Reader) -> np.ndarray:
    k = int(np.frombuffer(reader.take(2, "table size"), dtype="<u2")[0])
    if not 1 <= k <= 256:
        raise CodecError(f"rans table has {k} symbols")
    table = np.frombuffer(reader.take(3 * k, "table"), dtype=[("s", "u1"), ("f", "<u2")])
    syms, f = table["s"].astype(np.int64), table["f"].astype(np.int64)
    if np.any(np.diff(syms) <= 0) or np.any(f == 0) or int(f.sum()) != rk.PROB_SCALE:
        raise CodecError("rans frequency table is malformed")
    freqs = np.zeros(256, dtype=np.uint16)
    freqs[syms] = f
    return freqs


@numba.njit(cache=True, nogil=True, boundscheck=False)
def channel_medians(exps: np.ndarray) -> np.ndarray:
    """Lower median of each channel's exponents, by counting (exponents are bytes)."""
    outer, tokens, inner = exps.shape
    medians = np.empty((outer, inner), dtype=np.uint8)
    counts = np.zeros((inner, 256), dtype=np.int32)
    half = (tokens + 1) // 2
    for o in range(outer):
        counts[:, :] = 0
        for t in range(tokens):
            for i in range(inner):
                counts[i, exps[o, t, i]] += 1
        for i in range(inner):
            acc = 0
            for v in range(256):
                acc += counts[i, v]
                if acc >= half:
                    medians[o, i] = v
                    break
    return medians


@numba.njit(cache=True, nogil=True, boundscheck=False)
def shift_channels(values: np.ndarray, medians: np.ndarray, sign: int) -> np.ndarray:
    """``(values + sign * median of the channel) mod 256``: -1 makes residuals, +1 restores exponents."""
    outer, tokens, inner = values.shape
    out = np.empty_like(values)
    if inner == 1:  # page objects: the channel is a row (token_axis innermost); one loop over it vectorises
        for o in range(outer):
            m = sign * np.int32(medians[o, 0])
            for t in range(tokens):
                out[o, t, 0] = np.uint8((np.int32(values[o, t, 0]) + m) & 0xFF)
        return out
    for o in range(outer):
        for t in range(tokens):
            for i in range(inner):
                out[o, t, i] = np.uint8((np.int32(values[o, t, i]) + sign * np.int32(medians[o, i])) & 0xFF)
    return out
