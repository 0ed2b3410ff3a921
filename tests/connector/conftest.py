"""Fixtures of the engine tests that compare against a full recompute (float32: any split of a prefix
between loaded and recomputed tokens gives exactly its tokens)."""

from __future__ import annotations

import pytest

from tests.support.engine import engine, greedy


@pytest.fixture(scope="module")
def ids() -> list[int]:
    """900 tokens of real text: 7 chunks of 128 and a partial one."""
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(900)


@pytest.fixture(scope="module")
def recompute_tokens(ids) -> list[int]:
    with engine(dtype="float32", prefix_caching=False) as llm:
        return greedy(llm, ids)
