"""The layout interface: canonical KV in and out of one layer's paged memory.

A *page layout* is the only object in vllm-kvcodec that knows how an
attention backend lays K and V out inside vLLM's KV cache blocks. Everything
else (codecs, chunk format, store, fetcher) sees the canonical layout::

    [planes, tokens, kv_heads, head_dim]       per layer, in the cache's dtype
                                               (the model's, or float8 for fp8 caches)

with ``planes`` 2 (K and V) for attention that keeps K and V per head, and 1
(one latent per token, ``kv_heads`` 1) for multi-head latent attention.

A layout is bound to one geometry (block size, kv heads, head size, dtype)
and is stateless otherwise, so one instance serves every layer that shares the
geometry. It never keeps a reference to a cache tensor: each call gets the
tensor vLLM handed to ``KVConnectorBase_V1.register_kv_caches`` (or the
``kv_layer`` of ``save_kv_layer``) and a slot mapping.

Slots
    ``slot = block_id * block_size + offset_in_block`` (int32/int64, one per
    token, any order, any blocks; partial blocks are fine). ``block_size`` is
    the *kernel* block size, i.e. the token axis of the tensor the layout is
    given (``kv_cache.shape[2]``). Slot ids do not change when vLLM splits a
    manager block into kernel blocks, because kernel blocks are dense
    sub-pages: ``(b * r + j) * (bs / r) + o == b * bs + j * (bs / r) + o``.
    Negative slots (vLLM's ``PAD_SLOT_ID`` = -1) are rejected: drop padding
    before calling.

Identity: ``layout_id`` and ``canonical``
    ``layout_id`` names the byte layout of one (block, head) page, e.g.
    ``"cpu_attn-amx-v1"``; two layouts with the same id read and write the
    same bytes. ``canonical`` is True when :meth:`gather` returns exactly the
    K/V elements the cache holds for each token (no re-quantisation, no
    padding: for an fp8 cache, the float8 bytes the kernel wrote) and
    :meth:`scatter` writes them back bit-exactly, which is the case for every
    layout in this package. Chunks gathered by canonical layouts are
    interchangeable across layouts: a chunk saved on an AMX machine
    (``cpu_attn-amx-v1``) loads bit-exactly into a FlashAttention cache
    (``packed-kv-v1``). The connector should therefore key chunks with
    :attr:`PagedLayout.key_namespace`, which is the shared
    ``"canonical-v1"`` for canonical layouts and the ``layout_id`` for a
    non-canonical one, so that chunks of a non-canonical layout are only
    ever found by the same layout.
    (vLLM's own ``ExampleConnector`` copies pages raw, which is why a store
    written on an AMX machine decodes to garbage on a non-AMX one.)
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from vllm_kvcodec.errors import ConfigError

#: Namespace shared by every canonical layout (see the module docstring).
CANONICAL_NAMESPACE = "canonical-v1"

#: dtypes a canonical layout can hold (what a chunk can hold, see codecs/dtypes.py).
CANONICAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
#: The 1-byte formats of vLLM's fp8 KV caches. vLLM allocates those caches as ``torch.uint8``
#: (``STR_DTYPE_TO_TORCH_DTYPE``); a layout for one reads them as the float8 format they hold.
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class BlockRun(NamedTuple):
    """``count`` consecutive cache blocks from ``block`` on, taking the pages from ``at`` on of a source."""

    block: int
    at: int
    count: int


def block_runs(block_ids: Sequence[int]) -> list[BlockRun]:
    """``block_ids`` (host ints) as runs of consecutive ids: vLLM hands a new request mostly consecutive blocks."""
    runs: list[BlockRun] = []
    for at, block in enumerate(block_ids):
        if runs and runs[-1].block + runs[-1].count == block:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(BlockRun(block, at, 1))
    return runs


def cache_bytes(layer_cache: torch.Tensor) -> memoryview:
    """A contiguous host cache's own bytes, writable, without a copy (fp8: its uint8 storage); see ``page_extents``."""
    return memoryview(layer_cache.view(-1).view(torch.uint8).numpy())


class PagedLayoutError(ConfigError):
    """A KV cache tensor does not have the layout, geometry or dtype a layout expects."""


class UnknownLayoutError(PagedLayoutError):
    """No layout is known (or verified) for this backend / ISA / dtype: we never guess."""


class LayoutMismatchError(PagedLayoutError):
    """vLLM's own write op put bytes where the chosen layout does not expect them."""


class SlotError(PagedLayoutError, IndexError):
    """A slot mapping addresses tokens outside the cache, or is malformed."""


def _host_to_device(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """non_blocking is only safe host -> device (a device -> host copy may not have landed yet)."""
    return src.device.type == "cpu" and dst.device.type != "cpu"


@dataclass(frozen=True)
class Geometry:
    """What one layer's KV looks like, independent of the layout."""

    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1: one latent per token (MLA)

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PagedLayoutError(f"{name} must be a positive int, got {value!r}")
        if self.planes not in (1, 2):
            raise PagedLayoutError(f"planes must be 1 (a latent) or 2 (K and V), got {self.planes!r}")
        if self.dtype not in CANONICAL_DTYPES:
            raise UnknownLayoutError(
                f"KV cache dtype {self.dtype} is not supported: layouts move bfloat16, float16, "
                "float32 or float8 (e4m3fn, e5m2) KV bit-exactly; other quantised caches (nvfp4, int8/int4 "
                "per token-head, turboquant) carry scales or packing inside the page and are refused"
            )


class PagedLayout(abc.ABC):
    """Gather/scatter canonical ``[planes, tokens, kv_heads, head_dim]`` KV by slot mapping.

    Subclasses implement :meth:`_gather` and :meth:`_scatter` on validated
    inputs with vectorised torch indexing (no per-token Python loops); they
    work on any device torch indexes on (CPU here, CUDA for the GPU layouts).
    """

    #: byte layout of a page; equal ids mean equal bytes (see module docstring)
    layout_id: ClassVar[str]
    #: gather/scatter are exact inverses onto the canonical layout
    canonical: ClassVar[bool] = True
    #: vLLM attention backends (``AttentionBackend.get_name()``) that use this layout
    backends: ClassVar[tuple[str, ...]] = ()
    #: the axis of the cache tensor that indexes blocks (page copies select along it)
    block_axis: ClassVar[int] = 0

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry

    # ---- identity -------------------------------------------------------------------
    @property
    def key_namespace(self) -> str:
        """What the connector puts in its key namespace for chunks gathered here."""
        return CANONICAL_NAMESPACE if self.canonical else self.layout_id

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.geometry.num_kv_heads

    @property
    def head_size(self) -> int:
        return self.geometry.head_size

    @property
    def dtype(self) -> torch.dtype:
        return self.geometry.dtype

    @property
    def planes(self) -> int:
        return self.geometry.planes

    def token_nbytes(self) -> int:
        """Bytes of one token's canonical KV in one layer."""
        g = self.geometry
        return g.planes * g.num_kv_heads * g.head_size * g.dtype.itemsize

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"{type(self).__name__}(layout_id={self.layout_id!r}, block_size={g.block_size}, "
            f"num_kv_heads={g.num_kv_heads}, head_size={g.head_size}, dtype={g.dtype}"
            + (", planes=1)" if g.planes == 1 else ")")
        )

    # ---- the two operations ---------------------------------------------------------
    def gather(
        self,
        layer_cache: torch.Tensor,
        slots: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """Read the KV of ``slots`` out of one layer's paged memory.

        Returns a new (or the given ``out``) contiguous tensor
        ``[planes, len(slots), kv_heads, head_size]`` on the cache's device, in token
        order of ``slots``. ``check=False`` skips the slot bounds check (which
        costs a device sync on GPUs).
        """
        self.check_cache(layer_cache)
        layer_cache = self._elements(layer_cache)
        slots = self._slots(layer_cache, slots, check=check)
        g = self.geometry
        shape = (g.planes, slots.numel(), g.num_kv_heads, g.head_size)
        if out is None:
            out = torch.empty(shape, dtype=g.dtype, device=layer_cache.device)
        elif (
            tuple(out.shape) != shape
            or out.dtype != g.dtype
            or out.device != layer_cache.device
            or not out.is_contiguous()
        ):
            raise PagedLayoutError(
                f"out must be a contiguous {shape} {g.dtype} tensor on {layer_cache.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device} (contiguous={out.is_contiguous()})"
            )
        if slots.numel():
            self._gather(layer_cache, slots, out)
        return out

    def scatter(
        self, layer_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, *, check: bool = True
    ) -> None:
        """Write canonical ``kv`` ``[planes, len(slots), kv_heads, head_size]`` into ``slots``, in place.

        Only the bytes of the addressed tokens change. ``kv`` must have the
        cache's dtype (no silent casts); it is moved to the cache's device if
        needed. With ``check=True`` slots must also be unique (a duplicate
        slot would make the result depend on write order).
        """
        self.check_cache(layer_cache)
        layer_cache = self._elements(layer_cache)
        slots = self._slots(layer_cache, slots, check=check)
        g = self.geometry
        shape = (g.planes, slots.numel(), g.num_kv_heads, g.head_size)
        if tuple(kv.shape) != shape:
            raise PagedLayoutError(f"kv must have shape {shape}, got {tuple(kv.shape)}")
        if kv.dtype != g.dtype:
            raise PagedLayoutError(f"kv dtype {kv.dtype} != cache dtype {g.dtype} (no silent casts)")
        if check and slots.numel() > 1 and torch.unique(slots).numel() != slots.numel():
            raise SlotError("scatter slots must be unique")
        if not slots.numel():
            return
        kv = kv.to(layer_cache.device, non_blocking=_host_to_device(kv, layer_cache))
        self._scatter(layer_cache, slots, kv)

    # ---- whole pages, as they lie ---------------------------------------------------
    def read_pages(self, layer_cache: torch.Tensor, block_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The pages of ``block_ids``, byte for byte as the kernels wrote them: one block copy, no transform.

        Returns (or fills ``out`` with) the cache with its block axis
        narrowed to ``block_ids``, in their order. Only an engine whose page
        layout is this one can use the bytes (the key namespace pins it).
        """
        self.check_cache(layer_cache)
        ids, cache = self._block_ids(layer_cache, block_ids), self._elements(layer_cache)
        if out is not None:  # pages_shape keeps the cache's own axes; the element view may drop a unit axis (MLA)
            shape = list(cache.shape)
            shape[self.block_axis] = ids.numel()
            out = out.view(shape)
        if cache.dtype in FLOAT8_DTYPES:  # index kernels take no float8: the same bytes, moved as uint8
            got = torch.index_select(cache.view(torch.uint8), self.block_axis, ids,
                                     out=None if out is None else out.view(torch.uint8))
            return got.view(cache.dtype)
        return torch.index_select(cache, self.block_axis, ids, out=out)

    def write_pages(self, layer_cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor,
                    bounds: tuple[int, int] | None = None, runs: Sequence[BlockRun] | None = None) -> None:
        """Write whole pages read by :meth:`read_pages` (of an engine with this layout) into ``block_ids``.

        ``bounds``: ``(min, max)`` of host ``block_ids``, known to the caller
        that writes the same blocks of many layers; a load is then one kernel
        call per layer (each torch call hands the GIL over, and a loaded
        prefix is hundreds of small writes racing the engine's thread for it).
        ``runs``: ``block_runs(block_ids)``, from the same caller. On the host
        each run is one plain copy of contiguous pages (memcpy speed), where
        ``index_copy_`` moves element by element: 54 us against 6 us for two
        196 KB pages. A CUDA cache keeps the single ``index_copy_`` kernel.
        """
        self.check_cache(layer_cache)
        ids, cache = self._block_ids(layer_cache, block_ids, bounds), self._elements(layer_cache)
        want = list(cache.shape)
        want[self.block_axis] = ids.numel()
        if list(pages.shape) != want or pages.dtype != cache.dtype:
            raise PagedLayoutError(f"pages must be a {tuple(want)} {cache.dtype} tensor, got {tuple(pages.shape)} {pages.dtype}")
        src = pages if pages.device == cache.device else pages.to(cache.device, non_blocking=_host_to_device(pages, cache))
        if cache.dtype in FLOAT8_DTYPES:
            cache, src = cache.view(torch.uint8), src.view(torch.uint8)
        if runs is not None and cache.device.type == "cpu":
            axis = self.block_axis
            for block, at, count in runs:
                cache.narrow(axis, block, count).copy_(src.narrow(axis, at, count))
            return
        cache.index_copy_(self.block_axis, ids, src)

    def page_extents(self, layer_cache: torch.Tensor, runs: Sequence[BlockRun]) -> list[tuple[int, int]] | None:
        """Where the bytes :meth:`write_pages` would write for ``runs`` lie in the cache, as ``(byte offset, length)``
        in the order :meth:`read_pages` lays them out (``runs`` in ``at`` order, covering pages 0..n); None for a
        cache that is not one contiguous host tensor (then pages are written with :meth:`write_pages`).

        Why: a reader that fills buffers itself (``preadv`` from a local file)
        then writes stored pages straight into the cache (through
        :func:`cache_bytes`), with no intermediate copy. Block ids are
        range-checked here, before any byte is written.
        """
        self.check_cache(layer_cache)
        if layer_cache.device.type != "cpu" or not layer_cache.is_contiguous():
            return None
        limit, axis = self.num_blocks(layer_cache), self.block_axis
        if any(r.block < 0 or r.count < 1 or r.block + r.count > limit for r in runs):
            raise SlotError(f"block runs {list(runs)} outside a cache of {limit} blocks")
        item = layer_cache.element_size()
        block_bytes = layer_cache.stride(axis) * item
        leads = [0]
        for dim in range(axis):  # every index of the axes before the block axis, in C order
            leads = [lead + i * layer_cache.stride(dim) * item for lead in leads for i in range(layer_cache.shape[dim])]
        return [(lead + r.block * block_bytes, r.count * block_bytes) for lead in leads for r in runs]

    def pages_shape(self, layer_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
        """The shape :meth:`read_pages` returns for ``num_blocks`` blocks of this cache."""
        shape = list(layer_cache.shape)
        shape[self.block_axis] = num_blocks
        return tuple(shape)

    def _block_ids(self, layer_cache: torch.Tensor, block_ids: torch.Tensor,
                   bounds: tuple[int, int] | None = None) -> torch.Tensor:
        """Block ids as int64 on the cache's device, range-checked where they are on the host (no device sync)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if ids.dim() != 1:
            raise SlotError(f"block ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.device.type == "cpu" and ids.numel():
            lo, hi = bounds if bounds is not None else (int(ids.min()), int(ids.max()))
            limit = self.num_blocks(layer_cache)
            if lo < 0 or hi >= limit:
                raise SlotError(f"block ids span [{lo}, {hi}] but the cache holds {limit} blocks")
        if ids.device == layer_cache.device:
            return ids
        return ids.to(layer_cache.device, non_blocking=_host_to_device(ids, layer_cache))

    # ---- validation -----------------------------------------------------------------
    def check_cache(self, layer_cache: torch.Tensor) -> None:
        """Raise :class:`PagedLayoutError` unless ``layer_cache`` fits this layout."""
        if not isinstance(layer_cache, torch.Tensor):
            raise PagedLayoutError(f"expected a torch.Tensor KV cache, got {type(layer_cache).__name__}")
        if layer_cache.dtype != self.geometry.dtype and not self._is_float8_storage(layer_cache):
            raise PagedLayoutError(f"KV cache dtype {layer_cache.dtype} != layout dtype {self.geometry.dtype}")
        self._check_shape(layer_cache)

    def _is_float8_storage(self, layer_cache: torch.Tensor) -> bool:
        """vLLM's uint8 storage of a float8 cache: same bytes, read as the layout's float8 format."""
        return layer_cache.dtype == torch.uint8 and self.geometry.dtype in FLOAT8_DTYPES

    def _elements(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """The cache as elements of the layout's dtype (a view; the uint8 storage of fp8 caches is reinterpreted)."""
        return layer_cache.view(self.geometry.dtype) if self._is_float8_storage(layer_cache) else layer_cache

    def num_slots(self, layer_cache: torch.Tensor) -> int:
        """How many token slots the cache holds (``num_blocks * block_size``)."""
        return self.num_blocks(layer_cache) * self.geometry.block_size

    @abc.abstractmethod
    def num_blocks(self, layer_cache: torch.Tensor) -> int:
        """Number of (kernel) blocks in ``layer_cache``."""

    @abc.abstractmethod
    def _check_shape(self, layer_cache: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _gather(self, layer_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _scatter(self, layer_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None: ...

    def _slots(self, layer_cache: torch.Tensor, slots: torch.Tensor, *, check: bool) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor):
            slots = torch.as_tensor(slots, dtype=torch.int64)
        if slots.dim() != 1:
            raise SlotError(f"slot mapping must be 1-D, got shape {tuple(slots.shape)}")
        if slots.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise SlotError(f"slot mapping must hold integers, got {slots.dtype}")
        non_blocking = _host_to_device(slots, layer_cache)
        slots = slots.to(device=layer_cache.device, dtype=torch.int64, non_blocking=non_blocking)
        if check and slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            limit = self.num_slots(layer_cache)
            if lo < 0 or hi >= limit:
                raise SlotError(
                    f"slot mapping spans [{lo}, {hi}] but the cache holds slots [0, {limit}); "
                    "drop padding slots (-1) before gather/scatter"
                )
        return slots

    def _check_logical_bhn2d(self, c: torch.Tensor) -> None:
        """The logical ``[num_blocks, kv_heads, block_size, 2*head_size]`` view CPU_ATTN and packed layouts share."""
        g = self.geometry
        want = (g.num_kv_heads, g.block_size, 2 * g.head_size)
        if c.dim() != 4 or tuple(c.shape[1:]) != want:
            raise PagedLayoutError(
                f"{self.layout_id}: expected a [num_blocks, {want[0]}, {want[1]}, {want[2]}] "
                f"KV cache, got {tuple(c.shape)}"
            )

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.geometry.block_size
        return torch.div(slots, bs, rounding_mode="floor"), torch.remainder(slots, bs)
