"""The load path's fast page writes: runs of consecutive blocks copied as slices, and raw objects decoded without a copy.

Both are checked byte for byte against the path they replace (``index_copy_``
over the block ids, and a decode into a fresh array), for both CPU_ATTN page
layouts (VEC and AMX), the packed layouts whose block axis is not the first,
bf16, fp32 and fp8 caches, odd block patterns and partial objects.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.support.adversarial import torch_random_bits
from vllm_kvcodec.format import decode_payload, encode_chunk, read_header
from vllm_kvcodec.paged import CpuAttnAmxLayout, CpuAttnVecLayout, FlashSplitKVLayout, Geometry, PackedKVLayout
from vllm_kvcodec.paged.base import BlockRun, block_runs
from vllm_kvcodec.paged.cpu_attn import random_cache_bits
from vllm_kvcodec.paged.objects import PageObjects

H, D, BS, NB = 2, 32, 32, 24
LAYOUTS = [CpuAttnVecLayout, CpuAttnAmxLayout, PackedKVLayout, FlashSplitKVLayout]
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def _cache(cls, dtype, gen) -> torch.Tensor:
    shape = (2, NB, BS, H, D) if cls is FlashSplitKVLayout else (NB, H, BS, 2 * D)
    if dtype.itemsize == 1:  # vLLM's fp8 caches are uint8 tensors holding float8 bytes
        return random_cache_bits(shape, dtype, gen).view(torch.uint8)
    return torch_random_bits(shape, dtype, gen)


#: Page-write cases: a layout, a dtype, destination blocks (see :func:`destination`) and a seed.
PAGE_CASES = {
    "cls": st.sampled_from(LAYOUTS),
    "dtype": st.sampled_from(DTYPES),
    "blocks": st.lists(st.integers(0, NB - 1), min_size=1, max_size=8, unique=True),
    "consecutive": st.booleans(),
    "seed": st.integers(0, 2**16),
}


def destination(blocks: list[int], consecutive: bool) -> list[int]:
    """``blocks`` as drawn, or (vLLM's usual case) one run from the first of them, placed anywhere in the cache."""
    return list(range(blocks[0], min(NB, blocks[0] + len(blocks)))) if consecutive else blocks


def test_block_runs_split_where_ids_stop_being_consecutive() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 2, 3, 9, 8]) == [BlockRun(4, 0, 3), BlockRun(2, 3, 2), BlockRun(9, 5, 1), BlockRun(8, 6, 1)]


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 3), **PAGE_CASES)
def test_run_writes_equal_index_copy(cls, dtype, blocks, consecutive, start, seed) -> None:
    """A partial object (its pages from ``start`` on) written by runs equals the same write by ``index_copy_``."""
    blocks = destination(blocks, consecutive)
    gen = torch.Generator().manual_seed(seed)
    layout = cls(Geometry(H, D, BS, dtype))
    source, by_runs = _cache(cls, dtype, gen), _cache(cls, dtype, gen)
    by_index = by_runs.clone()
    objects = PageObjects(BS)
    obj = torch.empty(objects.object_shape(1, layout, source, (start + len(blocks)) * BS), dtype=dtype)
    objects.read(layout, source, list(range((start + len(blocks)) * BS)), obj[0])
    target = objects.target(layout, [b * BS + t for b in blocks for t in range(BS)], start * BS)
    assert target.runs is not None and sum(r.count for r in target.runs) == len(blocks)
    objects.write_to(layout, by_runs, target, obj[0])
    pages = obj[0].narrow(layout.block_axis, start, len(blocks))
    layout.write_pages(by_index, target.index, pages, target.bounds)  # no runs: the index_copy_ path
    assert torch.equal(by_runs.view(torch.uint8), by_index.view(torch.uint8))
    assert torch.equal(layout.read_pages(by_runs, target.index).view(torch.uint8), pages.contiguous().view(torch.uint8))


def test_runs_past_the_cache_are_refused_before_writing() -> None:
    layout = CpuAttnVecLayout(Geometry(H, D, BS, torch.bfloat16))
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    pages = torch.ones(2, H, BS, 2 * D, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        layout.write_pages(cache, torch.tensor([NB - 1, NB]), pages, runs=block_runs([NB - 1, NB]))
    assert not cache.any()


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # pytest resets the package's own filter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_borrowed_raw_decode_is_the_payload_itself(dtype) -> None:
    """The load path's raw decode hands over the blob's bytes (read-only, no copy); other codecs decode as ever."""
    gen = torch.Generator().manual_seed(5)
    kv = torch_random_bits((3, 2, 64, H, D), dtype, gen)
    for codec in ("raw", "zstd"):
        blob = encode_chunk(kv, codec)
        header = read_header(blob)
        borrowed, fresh = decode_payload(blob, header, borrow=True), decode_payload(blob, header)
        assert torch.equal(borrowed.view(torch.uint8), kv.view(torch.uint8))
        assert torch.equal(fresh.view(torch.uint8), kv.view(torch.uint8))
        shares = np.shares_memory(borrowed.view(torch.uint8).numpy(), np.frombuffer(blob, dtype=np.uint8))
        assert shares == (codec == "raw")
        assert not np.shares_memory(fresh.view(torch.uint8).numpy(), np.frombuffer(blob, dtype=np.uint8))
