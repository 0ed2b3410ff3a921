"""What a stored object holds: one layer group of one chunk, as canonical KV or as the pages it lies in.

Two object layouts, named in the key namespace (``Namespace.layout_id``), so an
engine only ever finds objects of its own kind:

``canonical-v1``: ``[layers, planes, chunk, kv_heads, head_dim]``
    The K and V values the model computed (or its latent: one plane, one
    head, for multi-head latent attention), independent of any attention
    backend: a chunk saved on an AMX machine loads into a FlashAttention cache.
    Every save and load transforms each page to and from this layout (the page
    layout's gather/scatter). Used when chunks are shared across platforms
    (``share_across_platforms``).

``pages-bs<block_size>-v1``: ``[layers, *cache shape with its block axis narrowed to the chunk's blocks]``
    The chunk's pages byte for byte as the kernels wrote them: a save and a
    load are block copies (``index_select`` / ``index_copy_`` over the block
    axis), several times faster than the transform, which is what a remote
    hit competes with the suffix prefill for. The bytes only mean something
    to an engine with the same page layout; the namespace's compute identity
    (platform, attention backend, CPU kernel ISA, vLLM version) pins that, so
    this is the default whenever it is in the namespace. Chunk boundaries are
    block boundaries (``chunk_size`` is a multiple of the block size), and a
    partial load starts at a block boundary (vLLM's local hits are whole
    blocks), so objects are always whole pages.

The codecs split values, not positions, so they apply to pages as they are;
the per-channel model of ``rans`` is told which axis is the page's innermost
(:attr:`ObjectLayout.token_axis`): measured on SmolLM2 KV in 256-token chunks,
1.506x on VEC pages and 1.486x on AMX pages against 1.512x canonical.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from vllm_kvcodec.paged.base import CANONICAL_NAMESPACE, BlockRun, PagedLayout, SlotError, block_runs


@dataclass(frozen=True)
class Target:
    """Where one span of an object goes in paged memory: ``count`` slots or blocks from ``start`` of the object.

    Checked once and shared by every layer of the object in the span's KV
    cache group: checked per layer, it cost more than the layer's copy.
    """

    index: torch.Tensor  # int64 on the host: slots (canonical objects) or block ids (page objects)
    start: int
    count: int
    bounds: tuple[int, int] | None = None  # (min, max) of index, where the writer range-checks with them
    runs: tuple[BlockRun, ...] | None = None  # page objects: index as runs of consecutive blocks


class ObjectLayout(abc.ABC):
    #: what the key namespace calls this kind of object
    namespace_id: str

    @abc.abstractmethod
    def object_shape(self, num_layers: int, layout: PagedLayout, cache: torch.Tensor, tokens: int) -> tuple[int, ...]:
        """The shape of an object of ``num_layers`` layers and ``tokens`` tokens (a whole chunk)."""

    @abc.abstractmethod
    def read(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
        """One layer's part of an object (``out``, its slice of the object) from paged memory."""

    def write(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], part: torch.Tensor, first_token: int) -> None:
        """One layer's part of a decoded object into paged memory, its tokens from ``first_token`` on (into ``slots``)."""
        self.write_to(layout, cache, self.target(layout, slots, first_token), part)

    @abc.abstractmethod
    def target(self, layout: PagedLayout, slots: list[int], first_token: int) -> Target:
        """Where a span (``slots``, its tokens from ``first_token`` of the object on) goes, for every layer of ``layout``."""

    @abc.abstractmethod
    def write_to(self, layout: PagedLayout, cache: torch.Tensor, target: Target, part: torch.Tensor) -> None:
        """One layer's part of a decoded object into paged memory, where :meth:`target` said."""

    def token_axis(self, ndim: int) -> int | None:
        """The axis a per-channel codec should treat as tokens (None: the codec's default, for canonical KV)."""
        return None

    @abc.abstractmethod
    def canonical(self, obj: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
        """An object's KV as ``[layers, planes, tokens, heads, head]`` (for inspection and tests: what it holds)."""


class CanonicalObjects(ObjectLayout):
    namespace_id = CANONICAL_NAMESPACE

    def object_shape(self, num_layers: int, layout: PagedLayout, cache: torch.Tensor, tokens: int) -> tuple[int, ...]:
        return (num_layers, layout.planes, tokens, layout.num_kv_heads, layout.head_size)

    def read(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
        layout.gather(cache, torch.tensor(slots, dtype=torch.int64), out=out, check=False)

    def target(self, layout: PagedLayout, slots: list[int], first_token: int) -> Target:
        return Target(torch.as_tensor(slots, dtype=torch.int64), first_token, len(slots))  # torch indexing range-checks slots

    def write_to(self, layout: PagedLayout, cache: torch.Tensor, target: Target, part: torch.Tensor) -> None:
        layout.scatter(cache, target.index, part[:, target.start : target.start + target.count], check=False)

    def canonical(self, obj: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
        return obj


class PageObjects(ObjectLayout):
    """Pages of the cache's own (kernel) blocks; the namespace names vLLM's block size, which the kernel's divides."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.namespace_id = page_namespace_id(block_size)

    def object_shape(self, num_layers: int, layout: PagedLayout, cache: torch.Tensor, tokens: int) -> tuple[int, ...]:
        return (num_layers, *layout.pages_shape(cache, tokens // layout.block_size))

    def read(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
        layout.read_pages(cache, torch.tensor(self.block_list(slots, layout.block_size), dtype=torch.int64), out=out)

    def target(self, layout: PagedLayout, slots: list[int], first_token: int) -> Target:
        bs = layout.block_size
        if first_token % bs:
            raise SlotError(f"a page object is loaded from a block boundary, not token {first_token}")
        blocks = self.block_list(slots, bs)
        bounds = (min(blocks, default=0), max(blocks, default=-1))
        return Target(torch.tensor(blocks, dtype=torch.int64), first_token // bs, len(blocks), bounds,
                      tuple(block_runs(blocks)))

    def write_to(self, layout: PagedLayout, cache: torch.Tensor, target: Target, part: torch.Tensor) -> None:
        axis = layout.block_axis
        whole = target.start == 0 and part.shape[axis] == target.count
        pages = part if whole else part.narrow(axis, target.start, target.count)
        layout.write_pages(cache, target.index, pages, target.bounds, target.runs)

    def token_axis(self, ndim: int) -> int:
        return ndim - 1  # the innermost axis of a page: a row of the kernel's own view of it

    def canonical(self, obj: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
        """Each layer's pages read as a small cache of their own, through the page layout."""
        tokens = obj.shape[1 + layout.block_axis] * layout.block_size
        return torch.stack([layout.gather(pages, torch.arange(tokens)) for pages in obj])

    @staticmethod
    def block_list(slots: list[int] | torch.Tensor, bs: int) -> list[int]:
        """The blocks of whole-block ``slots``, in token order; anything else is refused (in Python: no torch calls)."""
        values = slots.tolist() if isinstance(slots, torch.Tensor) else slots
        starts = values[::bs]
        if len(values) % bs or any(s % bs for s in starts):
            raise SlotError(f"page objects move whole blocks of {bs} tokens; got {len(values)} slots not block-aligned")
        return [s // bs for s in starts]


def page_namespace_id(block_size: int) -> str:
    return f"pages-bs{block_size}-v1"


def object_layout_for(namespace_id: str) -> ObjectLayout:
    """The object layout a key namespace names."""
    if namespace_id == CANONICAL_NAMESPACE:
        return CanonicalObjects()
    prefix = "pages-bs"
    if namespace_id.startswith(prefix) and namespace_id.endswith("-v1"):
        return PageObjects(int(namespace_id[len(prefix) : -len("-v1")]))
    raise ValueError(f"unknown object layout {namespace_id!r}")
