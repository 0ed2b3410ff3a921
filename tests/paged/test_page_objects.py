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
