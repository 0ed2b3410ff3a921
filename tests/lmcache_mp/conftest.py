"""Shared data for the lmcache_mp tests: real SmolLM2 KV in LMCache MP's layout."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lmcache")

from tests.lmcache_mp.harness import mp_layout  # noqa: E402
from tests.support.redis_server import redis_cluster_server, redis_cluster_url  # noqa: E402,F401


@pytest.fixture(scope="session")
def mp_chunks(real_chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Four real 256-token chunks as LMCache MP holds them: ``[2, 30, 256, 192]`` bf16, 5.9 MB each."""
    return [mp_layout(c) for c in real_chunks]
