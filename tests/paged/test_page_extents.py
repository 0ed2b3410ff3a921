"""Page extents: where a raw page object's bytes go when a reader fills the cache itself (reads in place).

Writing an object's payload into the extents ``page_extents`` names, in order,
must leave the cache byte for byte as ``write_pages`` leaves it, for both
CPU_ATTN page layouts (VEC and AMX), the packed layout, the split layout
whose block axis is not the first, bf16, fp32 and fp8 caches and odd block
patterns; blocks outside the cache are refused before any extent exists.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from tests.paged.test_page_runs import BS, NB, PAGE_CASES, H, D, _cache, destination
from vllm_kvcodec.paged import CpuAttnVecLayout, FlashSplitKVLayout, Geometry
from vllm_kvcodec.paged.base import SlotError, block_runs, cache_bytes
from vllm_kvcodec.paged.objects import PageObjects


@settings(max_examples=60, deadline=None)
@given(**PAGE_CASES)
def test_payload_into_extents_equals_write_pages(cls, dtype, blocks, consecutive, seed) -> None:
    blocks = destination(blocks, consecutive)
    gen = torch.Generator().manual_seed(seed)
    layout = cls(Geometry(H, D, BS, dtype))
    source, in_place = _cache(cls, dtype, gen), _cache(cls, dtype, gen)
    by_write = in_place.clone()
    objects = PageObjects(BS)
    obj = torch.empty(objects.object_shape(1, layout, source, len(blocks) * BS), dtype=dtype)
    objects.read(layout, source, [b * BS + t for b in range(len(blocks)) for t in range(BS)], obj[0])
    payload = obj[0].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()  # what a raw object stores

    runs = block_runs(blocks)
    extents = layout.page_extents(in_place, runs)
    assert extents is not None and sum(n for _, n in extents) == len(payload)
    raw, at = cache_bytes(in_place), 0
    for offset, n in extents:
        raw[offset : offset + n] = payload[at : at + n]
        at += n
    layout.write_pages(by_write, torch.tensor(blocks), obj[0], runs=runs)
    assert torch.equal(in_place.view(torch.uint8), by_write.view(torch.uint8))


def test_extents_refuse_blocks_outside_the_cache() -> None:
    layout = CpuAttnVecLayout(Geometry(H, D, BS, torch.bfloat16))
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    for blocks in ([NB - 1, NB], [-1, 0]):
        with pytest.raises(SlotError):
            layout.page_extents(cache, block_runs(blocks))


def test_no_extents_for_a_cache_that_is_not_one_contiguous_host_tensor() -> None:
    layout = FlashSplitKVLayout(Geometry(H, D, BS, torch.bfloat16))
    strided = torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16).transpose(0, 1)  # (2, NB, ...) as a view
    assert layout.page_extents(strided, block_runs([0, 1])) is None
