"""Fixtures of the connector tests: the engine tests that compare against a full recompute (float32: any
split of a prefix between loaded and recomputed tokens gives exactly its tokens), a test's own file store, and
the scheduler scenarios' lookup modes."""

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


@pytest.fixture
def store(tmp_path) -> str:
    """An empty file store of the test's own."""
    return f"file://{tmp_path / 'store'}"


@pytest.fixture(params=["sync", "async"], ids=["lookup-sync", "lookup-async"])
def lookup(request, monkeypatch) -> str:
    """The harness's engines' lookup mode: a scenario module that uses this fixture for all its tests
    (``pytest.mark.usefixtures("lookup")``) runs each with lookups inline and on the lookup thread."""
    from tests.support.scheduler_harness import lookup_modes

    return lookup_modes(request, monkeypatch)
