"""vLLM's ``kv_role`` in the real Scheduler: a producer saves and never loads, a consumer loads and never saves,
kv_both does both; ``save`` / ``load`` narrow a role, and a contradiction stops start-up with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from storage import open_store
from tests.support.scheduler_harness import Engine, loaded_tokens, loads_of, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def stored_keys(url: str) -> set[str]:
    """The store's chunk objects (not their block refs, see keys/block_refs.py: they come and go with them)."""
    with open_store(url) as s:
        return {k for k in s.keys() if not k.endswith("/ref")}


def serve(tmp_path: Path, store: str, req_id: str, tokens: list[int], **kw: Any) -> Engine:
    """One engine of ``kw``'s role runs one request to its end, its saves flushed."""
    e = Engine(tmp_path, store, **kw)
    e.add(req_id, tokens, max_tokens=2)
    e.run()
    e.flush()
    e.assert_empty()
    return e


@pytest.mark.parametrize("lookup", ["sync", "async"])
def test_a_producer_saves_and_never_loads(tmp_path, store, lookup) -> None:
    p = prompt(300)
    serve(tmp_path, store, "first", p, kv_role="kv_producer", lookup=lookup)
    keys = stored_keys(store)
    assert len(keys) == 299 // 32  # every full chunk it computed (one object each)
    e = serve(tmp_path, store, "again", p, kv_role="kv_producer", lookup=lookup)
    assert not loads_of(e) and e.scheduler_stats().get("hit_chunks", 0) == 0
    assert e.connector.scheduler.lookups is None, "a producer needs no lookup thread"
    assert stored_keys(store) == keys


@pytest.mark.parametrize("lookup", ["sync", "async"])
def test_a_consumer_loads_and_never_saves(tmp_path, store, lookup) -> None:
    p = prompt(300)
    serve(tmp_path, store, "producer", p, kv_role="kv_producer")
    keys = stored_keys(store)
    e = serve(tmp_path, store, "consumer", p[:290] + prompt(100, 1), kv_role="kv_consumer", lookup=lookup)
    assert loaded_tokens(e, "consumer") == 288
    assert stored_keys(store) == keys, "a consumer saved the chunks it computed"
    assert e.stats().get("saved_chunks", 0) == 0


def test_kv_both_loads_and_saves(tmp_path, store) -> None:
    p = prompt(300)
    serve(tmp_path, store, "producer", p[:100], kv_role="kv_producer")
    e = serve(tmp_path, store, "both", p, kv_role="kv_both")
    assert loaded_tokens(e, "both") == 96
    assert len(stored_keys(store)) == 299 // 32


def test_overrides_narrow_a_role(tmp_path, store) -> None:
    p = prompt(300)
    serve(tmp_path, store, "producer", p[:100], kv_role="kv_producer")
    e = serve(tmp_path, store, "load-only", p, kv_role="kv_both", save=False)
    assert loaded_tokens(e, "load-only") == 96 and len(stored_keys(store)) == 3


@pytest.mark.parametrize("role,extra", [("kv_consumer", {"save": True}), ("kv_producer", {"load": True})])
def test_a_contradiction_stops_start_up(tmp_path, store, role, extra) -> None:
    from vllm_kvcodec.errors import ConfigError

    with pytest.raises(ConfigError, match=f"contradicts kv_role '{role}'"):
        Engine(tmp_path, store, kv_role=role, **extra)
