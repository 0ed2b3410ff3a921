"""Fixtures of the chunk-format tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def small_kv(real_chunks) -> torch.Tensor:
    """A small slice of real KV: 4 layers, both of K and V, 32 tokens."""
    return real_chunks[0][:4, :, :32].contiguous()
