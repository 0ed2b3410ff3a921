"""The MLA latent layout: bit-exact against vLLM's own CPU MLA cache write, and refusals of what is not checked.

vLLM's ``CPUMLAImpl.do_kv_cache_update`` writes random bit patterns (NaNs,
infinities, subnormals) for the latent and rope parts of a token; the layout
must gather exactly those, scattering them into an empty cache must give the
same bytes, and only the addressed tokens may change.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.adversarial import torch_random_bits as random_bits
from vllm_kvcodec.paged import Geometry, PagedLayoutError, UnknownLayoutError, layout_for
from vllm_kvcodec.paged.base import LayoutMismatchError
from vllm_kvcodec.paged.latent import LatentLayout, verify_with_cpu_mla_write
from vllm_kvcodec.paged.objects import CanonicalObjects, PageObjects

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LORA, ROPE = 512, 64


def cpu_mla_write(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    CPUMLAImpl.do_kv_cache_update(None, latent[:, :LORA], latent[:, None, LORA:], cache, slots, "auto", None)


def odd_slots(blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Half the slots and three more, shuffled: partial blocks, not from 0, not in order."""
    return torch.randperm(blocks * block_size, generator=gen)[: blocks * block_size // 2 + 3]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype.itemsize == 4 else torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("view", ["backend", "connector"])
def test_gather_reads_what_vllms_cpu_mla_write_put_and_scatter_writes_the_same_bytes(dtype, block_size, view) -> None:
    """On the backend's ``[B, N, D]`` cache, and on the ``[B, 1, N, D]`` view vLLM hands a connector."""
    gen = torch.Generator().manual_seed(block_size)
    blocks = 5
    cache = torch.zeros((blocks, block_size, LORA + ROPE), dtype=dtype)
    layout = layout_for("CPU_MLA", cache if view == "backend" else cache[:, None])
    assert isinstance(layout, LatentLayout) and layout.planes == 1 and layout.num_kv_heads == 1
    slots = odd_slots(blocks, block_size, gen)
    latent = random_bits((slots.numel(), LORA + ROPE), dtype, gen)
    cpu_mla_write(cache, slots, latent)

    seen = cache if view == "backend" else cache[:, None]
    got = layout.gather(seen, slots)
    assert got.shape == (1, slots.numel(), 1, LORA + ROPE)
    assert torch.equal(bits(got[0, :, 0]), bits(latent))

    poison = random_bits(tuple(cache.shape), dtype, gen)
    mine = poison.clone()
    layout.scatter(mine if view == "backend" else mine[:, None], slots, got)
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[slots] = True
    flat_mine, flat_vllm, flat_poison = (bits(t).view(blocks * block_size, -1) for t in (mine, cache, poison))
    assert torch.equal(flat_mine[written], flat_vllm[written])  # the tokens addressed: vLLM's bytes
    assert torch.equal(flat_mine[~written], flat_poison[~written])  # every other token untouched


def test_the_check_against_vllms_write_passes_and_catches_a_wrong_layout() -> None:
    geometry = Geometry(num_kv_heads=1, head_size=LORA + ROPE, block_size=16, dtype=torch.bfloat16, planes=1)
    verify_with_cpu_mla_write(LatentLayout(geometry), LORA)

    class BlockMajorLayout(LatentLayout):  # reads token o of block b at b + o * num_blocks: wrong
        def _gather(self, layer_cache, slots, out):
            block, offset = self._split(slots)
            out[0, :, 0] = layer_cache.view(-1, self.head_size)[block + offset * layer_cache.shape[0]]

    with pytest.raises(LayoutMismatchError, match="CPU MLA write"):
        verify_with_cpu_mla_write(BlockMajorLayout(geometry), LORA)


def test_latent_pages_and_canonical_objects_round_trip() -> None:
    gen = torch.Generator().manual_seed(3)
    cache = random_bits((9, 16, LORA + ROPE), torch.bfloat16, gen)
    layout = layout_for("CPU_MLA", cache)
    blocks = [7, 2, 4, 5]  # a 64-token chunk in four blocks, out of order
    slots = [b * 16 + o for b in blocks for o in range(16)]
    for objects in (PageObjects(16), CanonicalObjects()):
        shape = objects.object_shape(1, layout, cache, 64)
        obj = torch.empty(shape, dtype=cache.dtype)
        objects.read(layout, cache, slots, obj[0])
        target = torch.zeros_like(cache)
        objects.write(layout, target, slots[16:], obj[0], 16)  # a load that starts one block in
        assert torch.equal(bits(target[blocks[1:]]), bits(cache[blocks[1:]]))
        assert not bits(target[blocks[0]]).any() and not bits(target[[0, 1, 3, 6, 8]]).any()
        assert torch.equal(bits(objects.canonical(obj, layout)[0]), bits(layout.gather(cache, torch.tensor(slots))))
    assert CanonicalObjects().object_shape(3, layout, cache, 64) == (3, 1, 64, 1, LORA + ROPE)


def test_what_the_latent_layout_refuses() -> None:
    bf = torch.zeros((4, 16, LORA + ROPE), dtype=torch.bfloat16)
    for backend in ("FLASHMLA", "CUTLASS_MLA", "TRITON_MLA", "AMX_MLA"):
        with pytest.raises(UnknownLayoutError, match="refusing to guess"):
            layout_for(backend, bf)
    with pytest.raises(UnknownLayoutError, match="fp8 latent"):
        layout_for("CPU_MLA", bf.view(torch.uint8)[..., : LORA + ROPE], kv_cache_dtype="fp8")
    with pytest.raises(UnknownLayoutError, match="not supported"):
        layout_for("CPU_MLA", bf, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(PagedLayoutError, match="num_blocks, \\(1,\\) block_size, head_size"):
        layout_for("CPU_MLA", torch.zeros((4, 2, 16, LORA + ROPE), dtype=torch.bfloat16))
    with pytest.raises(PagedLayoutError, match="head_size is 512"):
        layout_for("CPU_MLA", bf, head_size=512)
    with pytest.raises(PagedLayoutError, match="one plane and one head"):
        LatentLayout(Geometry(num_kv_heads=1, head_size=576, block_size=16, dtype=torch.bfloat16))
    layout = layout_for("CPU_MLA", bf)
    with pytest.raises(PagedLayoutError, match="kv must have shape \\(1, 2, 1, 576\\)"):
        layout.scatter(bf, torch.tensor([0, 1]), torch.zeros((2, 2, 1, 576), dtype=torch.bfloat16))
    with pytest.raises(PagedLayoutError, match="latent cache"):
        layout.check_cache(torch.zeros((4, 32, LORA + ROPE), dtype=torch.bfloat16))
