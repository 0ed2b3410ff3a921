"""Frame geometry of the ``video`` codec: how a chunk's exponent bytes become pictures.

Pure numpy, no PyAV: the geometry is a function of the chunk's shape alone, so
a decoder derives it from the (already validated) chunk header and checks the
payload against it before it allocates anything.

Layout version 1 (``layout=1`` in the codec config):

* **Rows.** The exponent bytes, in element (C) order, are cut into rows of
  ``row`` bytes. ``row`` is the product of the last two dimensions (for the
  canonical ``[layers, 2, tokens, kv_heads, head_dim]`` chunk: one token's
  ``kv_heads * head_dim`` channels), or the length of a 1-D tensor. So one row
  is one token of one (layer, K/V) pair and a column is one channel: a
  channel's exponent barely changes from token to token, which the codecs'
  vertical prediction exploits (measured best of five layouts).
  A row wider than :data:`MAX_WIDTH` is wrapped at :data:`MAX_WIDTH`. A row
  narrower than :data:`MIN_SIDE` is widened to ``k * row`` with
  ``k = ceil(MIN_SIDE / row)`` (k whole rows side by side), which keeps
  columns aligned with channels.
* **Picture width** ``width = roundup(row, 8)``; columns past ``row`` repeat
  the row's last byte.
* **Planes.** ``rows = ceil(n / row)`` rows fill planes of ``height`` rows, in
  order, and three consecutive planes form one 8-bit 4:4:4 picture (Y, U,
  V): ``frames = ceil(rows / (3 * MAX_PLANE_HEIGHT))`` and
  ``height = roundup(max(MIN_SIDE, ceil(rows / (3 * frames))), 8)``. For a
  256-token SmolLM2 chunk (30 layers, 3 heads, 64 dims) that is 5 pictures of
  192 x 1024, each plane holding 4 consecutive (layer, K/V) slabs.
* **Padding** (cropped on decode, never trusted): the unused tail of the last
  data row repeats the row above it (or the last value when there is only
  one row); rows past the data repeat the last data row.

Both sides are multiples of 8 (no HEVC conformance window, every minimum CU
whole) and at least 144 (NVDEC's minimum picture size for HEVC), at most
4096 x 1024 (inside NVDEC's 8192 x 8192 and every H.264/HEVC level we use).
"""

from __future__ import annotations

import dataclasses

import numpy as np

LAYOUT_VERSION = 1
PLANES = 3
ALIGN = 8
MIN_SIDE = 144
MAX_WIDTH = 4096
MAX_PLANE_HEIGHT = 1024


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class FrameGeometry:
    """Where ``n`` exponent bytes sit in ``frames`` pictures of ``width`` x ``height`` x 3 planes."""

    n: int
    row: int
    width: int
    height: int
    frames: int

    @property
    def rows(self) -> int:
        """Data rows (the last one may be partial)."""
        return -(-self.n // self.row)

    @property
    def plane_rows(self) -> int:
        """Rows of all planes of all pictures together, padding included."""
        return self.frames * PLANES * self.height

    @property
    def pixels(self) -> int:
        return self.plane_rows * self.width


def geometry(shape: tuple[int, ...]) -> FrameGeometry:
    """Layout version 1 for a chunk of ``shape`` (ndim >= 1, every dimension >= 1)."""
    if not shape or any(int(d) < 1 for d in shape):
        raise ValueError(f"shape {tuple(shape)} is empty")
    n = int(np.prod(shape, dtype=np.int64))
    row = int(shape[-1]) * int(shape[-2]) if len(shape) >= 2 else int(shape[-1])
    if row > MAX_WIDTH:
        row = MAX_WIDTH
    elif row < MIN_SIDE:
        row *= -(-MIN_SIDE // row)
    width = _roundup(row, ALIGN)
    rows = -(-n // row)
    frames = -(-rows // (PLANES * MAX_PLANE_HEIGHT))
    height = _roundup(max(MIN_SIDE, -(-rows // (PLANES * frames))), ALIGN)
    return FrameGeometry(n=n, row=row, width=width, height=height, frames=frames)


def to_planes(exps: np.ndarray, geo: FrameGeometry) -> np.ndarray:
    """Place ``n`` exponent bytes into a ``[frames, 3, height, width]`` uint8 array, padded."""
    flat = np.ascontiguousarray(exps, dtype=np.uint8).reshape(-1)
    if flat.size != geo.n:
        raise ValueError(f"{flat.size} exponents for a geometry of {geo.n}")
    buf = np.empty((geo.plane_rows, geo.width), dtype=np.uint8)
    full, rem = divmod(geo.n, geo.row)
    buf[:full, : geo.row] = flat[: full * geo.row].reshape(full, geo.row)
    used = full
    if rem:
        buf[full, :rem] = flat[full * geo.row :]
        buf[full, rem : geo.row] = buf[full - 1, rem : geo.row] if full else flat[-1]
        used += 1
    buf[used:, : geo.row] = buf[used - 1, : geo.row]
    buf[:, geo.row :] = buf[:, geo.row - 1 : geo.row]
    return buf.reshape(geo.frames, PLANES, geo.height, geo.width)


def from_planes(planes: np.ndarray, geo: FrameGeometry) -> np.ndarray:
    """Inverse of :func:`to_planes`: crop the padding, return ``n`` exponent bytes (a new array)."""
    buf = planes.reshape(geo.plane_rows, geo.width)
    return np.ascontiguousarray(buf[: geo.rows, : geo.row]).reshape(-1)[: geo.n].copy()
