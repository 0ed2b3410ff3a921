"""Raw page objects read from a local file straight into paged memory: one copy, as vLLM's own connectors do.

The usual load path reads an object into a new buffer, then copies its pages
into the cache: two copies of every byte, and a fresh buffer to fault in. When
the store keeps values in local files (:attr:`storage.Store.ranged_reads`), the
objects are pages (``object_layout: pages``), the caches are one contiguous
host tensor per layer, the codec is raw and the object lands whole (every
layer in one KV cache group, from its first block on), the payload is read
with one ``preadv`` into the destination blocks instead. Anything else (a
compressed object, a partial span, a window group's share) reads the whole
value and goes the usual way. Objects fetched as bytes (from any store) that
land whole are still copied without tensors: :func:`copy_into` moves their
payload (raw) or decoded array into the same page extents.

The input is still untrusted, and the order of checks keeps that safe: the
header (magic, version, every size against the file's length, the key the
object is bound to, the shape, dtype and codec this engine expects) and the
destination blocks are validated before a byte is written; the checksum over
the header, the pages as written and the trailer is verified after. A
mismatch fails the object like any corrupt one: the blocks it wrote belong to
this load alone, and vLLM recomputes them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from storage.ranged import RangedValue
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.into_pages import PageExtents
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import CHECKSUM_BYTES, MAX_HEADER_BYTES, ChunkHeader, header_length, parse_header
from vllm_kvcodec.paged import PagedLayout
from vllm_kvcodec.paged.base import block_runs, cache_bytes
from vllm_kvcodec.paged.objects import PageObjects
from vllm_kvcodec.plans.spans import Span

_RAW_CONFIG = get_codec("raw").get_config()


class PageRun(NamedTuple):
    """``nbytes`` of a page object's payload that lie at ``offset`` in ``layer``'s host cache."""

    layer: int
    offset: int
    nbytes: int


class LayerBytes(NamedTuple):
    """A layer's host cache as bytes, what its page extents depend on, and its address (caches never change)."""

    raw: memoryview
    geometry: tuple[object, ...]
    address: int


class PageGeometry:
    """Where a page object's payload lies in host caches (their bytes and addresses, computed once per layer:
    caches never change): what reads in place and :func:`copy_into` write, run by run."""

    def __init__(self, caches: list[torch.Tensor], layouts: list[PagedLayout], cache_groups: list[int]) -> None:
        self.caches, self.layouts, self.cache_groups = caches, layouts, cache_groups
        self._cache_bytes: dict[int, LayerBytes] = {}

    def runs(self, layers: list[int], spans: list[Span], header: ChunkHeader) -> list[PageRun] | None:
        """Where a page object's bytes go in host caches, in payload order; None unless it lands whole in one
        group's blocks (then the placement writes it)."""
        groups = {self.cache_groups[layer] for layer in layers}
        span = spans[groups.pop()] if len(groups) == 1 else None
        if span is None or not span.slots:
            return None
        first = self.layouts[layers[0]]
        bs = first.block_size
        if span.first_token % bs or len(span.slots) != header.shape[1 + first.block_axis] * bs:
            return None
        runs = block_runs(PageObjects.block_list(span.slots, bs))
        out: list[PageRun] = []
        extents: list[tuple[int, int]] | None = None
        seen: tuple[object, ...] | None = None
        for layer in layers:
            same = self._layer_bytes(layer).geometry
            if extents is None or same != seen:  # layers alike (layout, shape, strides, dtype) share the extents
                extents, seen = self.layouts[layer].page_extents(self.caches[layer], runs), same
                if extents is None:
                    return None
            out += [PageRun(layer, at, n) for at, n in extents]
        return out

    def buffers(self, runs: list[PageRun]) -> list[memoryview]:
        return [self._layer_bytes(r.layer).raw[r.offset : r.offset + r.nbytes] for r in runs]

    def extents(self, runs: list[PageRun]) -> PageExtents:
        """The runs as addresses for a kernel: each layer's base plus the offset, no view or array per run
        (building those cost 2 ms of a 4096-token load)."""
        layers = {r.layer for r in runs}
        return PageExtents.within([self._layer_bytes(layer).raw for layer in layers],
                                  [self._layer_bytes(r.layer).address + r.offset for r in runs], [r.nbytes for r in runs])

    def _layer_bytes(self, layer: int) -> LayerBytes:
        """Computed once per layer: caches never change."""
        if (known := self._cache_bytes.get(layer)) is None:
            cache, layout = self.caches[layer], self.layouts[layer]
            raw = cache_bytes(cache) if cache.device.type == "cpu" and cache.is_contiguous() else memoryview(b"")
            address = np.frombuffer(raw, dtype=np.uint8).ctypes.data if raw.nbytes else 0
            known = self._cache_bytes[layer] = LayerBytes(raw, (type(layout), layout.geometry, tuple(cache.shape),
                                                                tuple(cache.stride()), cache.dtype, raw.nbytes), address)
        return known


def read_head(value: RangedValue, key: str) -> tuple[bytes, ChunkHeader]:
    """The object's header bytes and what they say, validated against the value's length and ``key``."""
    prefix = value.read(0, min(value.size, MAX_HEADER_BYTES))  # one pread holds any header
    head = prefix[: header_length(prefix)]
    return head, parse_header(head, value.size, key=key)


def is_raw(header: ChunkHeader) -> bool:
    """The payload is the pages' bytes as they lie in memory on this host."""
    return header.codec_config == _RAW_CONFIG and header.payload_length == header.raw_nbytes and sys.byteorder == "little"


def read_pages_into(value: RangedValue, head: bytes, header: ChunkHeader, buffers: Sequence[memoryview],
                    write: Callable[[Callable[[], None]], None]) -> float:
    """Fill ``buffers`` (the object's pages in payload order) from ``value``, then verify the checksum over them.

    ``write`` runs the read as the load's write into paged memory (it refuses
    once the load was cancelled). Returns the seconds spent on the checksum.
    """
    _check_fits(header.payload_length, buffers)
    write(lambda: value.read_into(header.payload_offset, buffers))
    t0 = time.perf_counter()
    digest = xxhash.xxh3_64(head)
    for b in buffers:
        digest.update(b)
    stored = int.from_bytes(value.read(value.size - CHECKSUM_BYTES, CHECKSUM_BYTES), "little")
    if digest.intdigest() != stored:
        raise ChunkFormatError("checksum mismatch: the chunk is corrupted (its pages are recomputed)")
    return time.perf_counter() - t0


def copy_into(payload: memoryview, buffers: Sequence[memoryview]) -> None:
    """An object's pages (a validated raw payload or a decoded array) into ``buffers``, in order: memory copies.

    Why not the torch page writes: for 94 MB in 480 layer copies this is 11 ms
    on one thread against 26 ms (no tensors built, no per-call dispatch). Why
    numpy and not ``b[:] = ...``: a memoryview copy holds the GIL for its whole
    memcpy, which stalls the engine's own thread and the other loaders (94 MB:
    12 ms on 1, 2 or 4 threads); numpy lets it go (6 ms on 2 threads).
    """
    _check_fits(payload.nbytes, buffers)
    source = np.frombuffer(payload, dtype=np.uint8)
    at = 0
    for b in buffers:
        np.copyto(np.frombuffer(b, dtype=np.uint8), source[at : at + b.nbytes])
        at += b.nbytes


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A decoded object's bytes (a new, contiguous host tensor), without a copy: the source of :func:`copy_into`."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _check_fits(nbytes: int, buffers: Sequence[memoryview]) -> None:
    if (pages := sum(b.nbytes for b in buffers)) != nbytes:
        raise ChunkFormatError(f"payload of {nbytes} bytes for {pages} bytes of pages")
