"""Fixtures of the engine tests that compare against a full recompute (float32: any split of a prefix
between loaded and recomputed tokens gives exactly its tokens)."""

from __future__ import annotations

import pytest

from tests.support.engine import greedy
from tests.support.engine_pool import plain


@pytest.fixture(scope="session")
def ids() -> list[int]:
    """900 tokens of real text: 7 chunks of 128 and a partial one."""
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(900)


@pytest.fixture(scope="session")
def recompute_tokens(ids, engines) -> list[int]:
    return greedy(engines.get(plain("float32", prefix_caching=False)).llm, ids)
