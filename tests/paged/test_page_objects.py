"""Stored objects as pages (block copies) or canonical KV: exact round trips for every page layout."""

from __future__ import annotations

import pytest
import torch

from tests.support.adversarial import torch_random_bits
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.paged import (
    CpuAttnAmxLayout, CpuAttnVecLayout, FlashInferSplitKVLayout, FlashSplitKVLayout, Geometry, PackedKVLayout, SlotError,
)
from vllm_kvcodec.paged.objects import CanonicalObjects, PageObjects, object_layout_for

H, D, BS, NB = 3, 64, 32, 12


def cache_for(cls, gen: torch.Generator) -> torch.Tensor:
    shape = {FlashSplitKVLayout: (2, NB, BS, H, D), FlashInferSplitKVLayout: (NB, 2, BS, H, D)}.get(cls, (NB, H, BS, 2 * D))
    return torch_random_bits(shape, torch.bfloat16, gen)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("cls", [CpuAttnVecLayout, CpuAttnAmxLayout, PackedKVLayout, FlashSplitKVLayout, FlashInferSplitKVLayout])
def test_page_objects_move_the_exact_bytes_of_whole_blocks(cls) -> None:
    gen = torch.Generator().manual_seed(1)
    layout = cls(Geometry(H, D, BS, torch.bfloat16))
    src, dst = cache_for(cls, gen), torch.zeros_like(cache_for(cls, gen))
    objects = PageObjects(BS)
    src_blocks, dst_blocks = [7, 2, 9], [0, 11, 4]
    slots = lambda blocks: [b * BS + t for b in blocks for t in range(BS)]  # noqa: E731 - a chunk's slots
    obj = torch.empty(objects.object_shape(1, layout, src, 3 * BS), dtype=torch.bfloat16)
    objects.read(layout, src, slots(src_blocks), obj[0])
    objects.write(layout, dst, slots(dst_blocks), obj[0], first_token=0)
    for s, d in zip(src_blocks, dst_blocks):
        assert torch.equal(bits(layout.read_pages(src, torch.tensor([s]))), bits(layout.read_pages(dst, torch.tensor([d]))))
    # what the object holds, read through the page layout, is the KV the canonical path would store
    want = layout.gather(src, torch.tensor(slots(src_blocks)))
    assert torch.equal(bits(objects.canonical(obj, layout)[0]), bits(want))
    # a partial load from a block boundary writes only the blocks from there on
    part = torch.zeros_like(dst)
    objects.write(layout, part, slots(dst_blocks[1:]), obj[0], first_token=BS)
    assert torch.equal(bits(layout.read_pages(part, torch.tensor(dst_blocks[1:]))),
                       bits(layout.read_pages(dst, torch.tensor(dst_blocks[1:]))))
    assert not bits(layout.read_pages(part, torch.tensor(dst_blocks[:1]))).any()


def test_page_objects_refuse_what_is_not_whole_blocks() -> None:
    layout = CpuAttnVecLayout(Geometry(H, D, BS, torch.bfloat16))
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    out = torch.empty(PageObjects(BS).object_shape(1, layout, cache, BS)[1:], dtype=torch.bfloat16)
    with pytest.raises(SlotError, match="whole blocks"):
        PageObjects(BS).read(layout, cache, list(range(5, 5 + BS)), out)
    with pytest.raises(SlotError, match="block boundary"):
        PageObjects(BS).write(layout, cache, list(range(BS)), out[None][0], first_token=3)
    with pytest.raises(SlotError, match="cache holds"):
        layout.read_pages(cache, torch.tensor([NB]))


def test_object_layout_follows_the_config() -> None:
    assert ConnectorConfig().object_layout_id(128) == "pages-bs128-v1"
    assert ConnectorConfig(share_across_platforms=True).object_layout_id(128) == "canonical-v1"
    assert ConnectorConfig(object_layout="canonical").object_layout_id(64) == "canonical-v1"
    with pytest.raises(ConfigError, match="share_across_platforms"):
        ConnectorConfig(object_layout="pages", share_across_platforms=True).object_layout_id(128)
    assert isinstance(object_layout_for("pages-bs64-v1"), PageObjects) and object_layout_for("pages-bs64-v1").block_size == 64
    assert isinstance(object_layout_for("canonical-v1"), CanonicalObjects)
    with pytest.raises(ValueError):
        object_layout_for("pages-v2")


@pytest.mark.parametrize("objects", [PageObjects(BS), CanonicalObjects()], ids=["pages", "canonical"])
@pytest.mark.parametrize("cls", [CpuAttnVecLayout, CpuAttnAmxLayout])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_placement_writes_every_layer_where_a_per_layer_write_would(objects, cls, dtype) -> None:
    """The fetcher's write of a whole object (each group's span checked once) is byte for byte the per-layer write.

    Four layers in three KV cache groups: a full span, a span that starts one
    block into the chunk (a window, or a local hit), and an empty span.
    """
    from vllm_kvcodec.load.placement import Decoded, HostPlacement
    from vllm_kvcodec.plans.spans import Span

    gen = torch.Generator().manual_seed(3)
    layout = cls(Geometry(H, D, BS, dtype))
    groups, blocks = [0, 1, 0, 2], [[5, 1, 8], [10, 3], []]
    spans = [Span(BS * (3 - len(b)), [x * BS + t for x in b for t in range(BS)]) for b in blocks]
    caches = [torch_random_bits((NB, H, BS, 2 * D), dtype, gen) for _ in groups]
    source = torch_random_bits((NB, H, BS, 2 * D), dtype, gen)
    obj = torch.empty(objects.object_shape(len(groups), layout, source, 3 * BS), dtype=dtype)
    for i in range(len(groups)):
        objects.read(layout, source, [x * BS + t for x in (2, 6, 9) for t in range(BS)], obj[i])
    want = [c.clone() for c in caches]
    for i, g in enumerate(groups):
        if spans[g].slots:
            objects.write(layout, want[i], spans[g].slots, obj[i], spans[g].first_token)
    placement = HostPlacement(caches, [layout] * len(groups), groups)
    placement.objects = objects
    placement.write_layers(range(len(groups)), Decoded(obj, spans))
    for got, expected in zip(caches, want):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(caches[0].view(torch.uint8), want[3].view(torch.uint8))  # the writes did land
    spans[0] = Span(0, [x * BS + t for x in (5, 1, NB) for t in range(BS)])  # past the cache: refused, not written
    with pytest.raises(SlotError if isinstance(objects, PageObjects) else IndexError):
        placement.write_layers(range(len(groups)), Decoded(obj, spans))
