"""A prompt of real text, its real SmolLM2 KV as CPU-tier rows, engines of vLLM's scheduler side with KVCodecTier."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tests.support.offload_engine import BLOCK, OffloadEngine

ROWS = 8  # blocks of the prompt (and rows of KV) the tests use


@pytest.fixture(scope="session")
def tokens() -> list[int]:
    """A prompt of ROWS full blocks and one token more (the scheduler never loads a prompt's last token)."""
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(ROWS * BLOCK + 1)


@pytest.fixture(scope="session")
def blocks(real_kv_1k: torch.Tensor) -> torch.Tensor:
    """The prompt's ROWS blocks of real KV, one CPU-tier row each, as bytes: per layer, the block's K then V,
    ``[2, block_size, kv_heads, head_dim]`` bf16, as a FlashAttention CPU copy lays it out."""
    layers, _, _, heads, dim = real_kv_1k.shape
    kv = real_kv_1k[:, :, : ROWS * BLOCK].reshape(layers, 2, ROWS, BLOCK, heads, dim)
    return kv.permute(2, 0, 1, 3, 4, 5).contiguous().reshape(ROWS, -1).view(torch.uint8)


@pytest.fixture
def engine() -> Iterator[Callable[..., OffloadEngine]]:
    """Makes engines (``OffloadEngine``'s arguments); every one is shut down after the test."""
    made: list[OffloadEngine] = []

    def make(store: str, **kwargs: object) -> OffloadEngine:
        made.append(OffloadEngine(store, **kwargs))
        return made[-1]

    yield make
    for e in made:
        e.shutdown()
