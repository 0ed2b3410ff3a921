"""vLLM's ``reset_prefix_cache(reset_connector=True)``: the connector forgets what it learnt of its store.

An instance remembers the chunks it saved (so a burst saves a new prefix once)
and the chunks whose loads failed (so they are not offered again at once), each
for a minute. After a reset of the connector's cache it looks chunks up and
saves them as a fresh instance would: a chunk it saved before is saved again
once gone from the store, and a chunk whose load failed is offered again once
whole. The store itself is shared with other instances and stays as it is.
Scenarios on vLLM's real Scheduler (tests/support/scheduler_harness.py).
"""

from __future__ import annotations


import pytest

from storage import open_store
from tests.support.scheduler_harness import Engine, loaded_tokens, prompt, reload

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK = 32  # the harness's default chunk size


def run(engine: Engine, req_id: str, tokens: list[int]) -> None:
    engine.add(req_id, tokens, max_tokens=1)
    engine.run()
    engine.flush()


def test_a_chunk_saved_before_the_reset_is_saved_again_once_gone_from_the_store(tmp_path, store) -> None:
    p = prompt(300)
    e = Engine(tmp_path, store)
    run(e, "first", p)
    saved = e.stats()["saved_chunks"]
    assert saved == (len(p) - 1) // CHUNK
    with open_store(store) as s:  # another instance's eviction, say
        for key in list(s.keys()):
            s.delete(key)
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    run(e, "again", p)
    assert e.stats()["saved_chunks"] == 2 * saved, "chunks this instance saved before the reset were not saved again"
    assert reload(Engine(tmp_path, store), p) == saved * CHUNK
    e.assert_empty()


def test_a_chunk_whose_load_failed_is_offered_again_after_the_reset(tmp_path, store) -> None:
    p = prompt(300)
    run(Engine(tmp_path, store), "producer", p)
    reader = Engine(tmp_path, store, kv_role="kv_consumer")  # it never saves: nothing replaces what failed
    keys = object_keys(reader, p, chunk=1)
    with open_store(store) as s:
        whole = {key: s.get(key) for key in keys}
        for key, blob in whole.items():
            s.put(key, blob[:-1] + bytes([blob[-1] ^ 0x40]))
    run(reader, "fails", p)
    failures = reader.stats()["load_failures"]
    assert failures >= 1
    with open_store(store) as s:
        for key, blob in whole.items():
            s.put(key, blob)  # whole again (another instance saved it, say)
    assert reader.scheduler.reset_prefix_cache(reset_connector=True)
    run(reader, "whole", p)
    assert loaded_tokens(reader, "whole") == (len(p) - 1) // CHUNK * CHUNK, "the chunk that failed was not offered"
    assert reader.stats()["load_failures"] == failures
    reader.assert_empty()


def object_keys(engine: Engine, tokens: list[int], chunk: int) -> list[str]:
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    ns = engine.connector.scheduler.namespace
    h = chunk_hashes(ns, tokens, chunk + 1)[chunk]
    return [object_key(ns, h, 0, g) for g in range(len(engine.worker.worker.groups))]
