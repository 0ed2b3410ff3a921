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

import torch

from vllm_kvcodec.paged.base import CANONICAL_NAMESPACE, PagedLayout, SlotError


class ObjectLayout(abc.ABC):
    #: what the key namespace calls this kind of object
    namespace_id: str

    @abc.abstractmethod
    def object_shape(self, num_layers: int, layout: PagedLayout, cache: torch.Tensor, tokens: int) -> tuple[int, ...]:
        """The shape of an object of ``num_layers`` layers and ``tokens`` tokens (a whole chunk)."""

    @abc.abstractmethod
    def read(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
        """One layer's part of an object (``out``, its slice of the object) from paged memory."""

    @abc.abstractmethod
    def write(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], part: torch.Tensor, first_token: int) -> None:
        """One layer's part of a decoded object into paged memory, its tokens from ``first_token`` on (into ``slots``)."""

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

    def write(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], part: torch.Tensor, first_token: int) -> None:
        layout.scatter(cache, torch.as_tensor(slots, dtype=torch.int64), part[:, first_token : first_token + len(slots)], check=False)

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
        layout.read_pages(cache, self._blocks(slots, layout.block_size), out=out)

    def write(self, layout: PagedLayout, cache: torch.Tensor, slots: list[int], part: torch.Tensor, first_token: int) -> None:
        bs = layout.block_size
        if first_token % bs:
            raise SlotError(f"a page object is loaded from a block boundary, not token {first_token}")
        blocks = self._blocks(slots, bs)
        layout.write_pages(cache, blocks, part.narrow(layout.block_axis, first_token // bs, blocks.numel()))

    def token_axis(self, ndim: int) -> int:
        return ndim - 1  # the innermost axis of a page: a row of the kernel's own view of it

    def canonical(self, obj: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
        """Each layer's pages read as a small cache of their own, through the page layout."""
        tokens = obj.shape[1 + layout.block_axis] * layout.block_size
        return torch.stack([layout.gather(pages, torch.arange(tokens)) for pages in obj])

    @staticmethod
    def _blocks(slots: list[int], bs: int) -> torch.Tensor:
        """The blocks of whole-block ``slots``, in token order; anything else is refused."""
        starts = torch.as_tensor(slots, dtype=torch.int64)[::bs]
        if len(slots) % bs or bool((starts % bs).any()):
            raise SlotError(f"page objects move whole blocks of {bs} tokens; got {len(slots)} slots not block-aligned")
        return starts // bs


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
