"""A store that returns another object than was asked for: a failed or missed load, recomputed, never wrong KV.

A shared store outlives the engines that fill it and is reached through
proxies, replicas and operators' tools; a value can come back for the wrong
key without a bit of it damaged. Each scenario tampers with a real file store
the way that happens (objects swapped, refs swapped, a ref naming another
prompt's object, an object written under the wrong key by a writer that keyed
a request wrongly), then a fresh engine loads through it in vLLM's real
Scheduler; the harness checks that every request reads exactly its own KV in
every step (see :mod:`tests.support.scheduler_harness`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scheduler_harness import Engine, loaded_tokens, prompt
from vllm_kvcodec.keys.block_refs import Ref, encode_ref, ref_key
from vllm_kvcodec.format import decode_payload, encode_chunk, read_header
from vllm_kvcodec.keys.chain import chunk_hashes, object_key, tail_hash

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]

P, Q = prompt(100, 1), prompt(100, 2)  # chunks of 32, blocks of 16: 3 full chunks each


def stored(tmp_path: Path, store: str) -> Engine:
    """P and Q computed and saved by one engine, which stays up (its store and namespace are the fixtures')."""
    e = Engine(tmp_path, store)
    for name, tokens in (("p", P), ("q", Q)):
        e.add(name, tokens, max_tokens=1)
        e.run()
    e.flush()
    e.assert_empty()
    return e


def objects(e: Engine, tokens: list[int], chunk: int) -> list[str]:
    ns = e.connector.scheduler.namespace
    h = chunk_hashes(ns, tokens, chunk + 1)[chunk]
    return [object_key(ns, h, 0, g) for g in range(len(ns.layer_groups()))]


def ref_of(e: Engine, tokens: list[int], chunk: int, prefix: int) -> str:
    """The key of the ref for the first ``prefix`` tokens of ``tokens``' chunk ``chunk``."""
    ns = e.connector.scheduler.namespace
    return ref_key(ns, tail_hash(ns, tokens, chunk_hashes(ns, tokens, chunk), prefix))


def swap(store, a: str, b: str) -> None:
    va, vb = store.get(a), store.get(b)
    assert va is not None and vb is not None and va != vb
    store.put(a, vb)
    store.put(b, va)


def replay(tmp_path: Path, store: str, tokens: list[int]) -> Engine:
    """A fresh engine (no local cache) runs ``tokens`` to its end through the tampered store."""
    f = Engine(tmp_path, store)
    f.add("r", tokens, max_tokens=1)
    f.run()
    f.assert_empty()
    return f


def diverging(tokens: list[int]) -> list[int]:
    """``tokens``' first 48 (chunk 0 and one block of chunk 1), then others: a hit that ends through a ref."""
    return tokens[:48] + prompt(40, 9)


def test_swapped_objects_fail_their_load_and_are_recomputed(tmp_path, store) -> None:
    e = stored(tmp_path, store)
    for a, b in zip(objects(e, P, 1), objects(e, Q, 1)):
        swap(e.connector.scheduler.store, a, b)
    f = replay(tmp_path, store, P)
    assert f.stats()["load_failures_corrupt"] >= 1  # bound to Q's key: rejected before a byte is written


def test_swapped_refs_are_no_refs(tmp_path, store) -> None:
    """A ref read from under another prefix's key names that prefix: it is not used (counted), the blocks are
    computed."""
    e = stored(tmp_path, store)
    swap(e.connector.scheduler.store, ref_of(e, P, 1, 16), ref_of(e, Q, 1, 16))
    f = replay(tmp_path, store, diverging(P))
    assert loaded_tokens(f, "r") == 32  # chunk 0 only
    assert f.scheduler_stats()["refs_invalid"] == 1


def test_a_ref_naming_another_prompts_object_fails_on_its_tokens(tmp_path, store) -> None:
    """A ref bound to its own key but naming an object of other tokens (a writer's bug): the object's token
    digests are not the prompt's, so the load fails before it writes, and the blocks are recomputed."""
    e = stored(tmp_path, store)
    ns = e.connector.scheduler.namespace
    key = ref_of(e, P, 1, 16)
    prefix = key.split("/")[2]
    e.connector.scheduler.store.put(key, encode_ref(prefix, 16, Ref(chunk_hashes(ns, Q, 2)[1], 32)))
    f = replay(tmp_path, store, diverging(P))
    assert f.stats()["load_failures_tokens"] >= 1


def test_an_object_keyed_for_the_wrong_prompt_fails_on_its_tokens(tmp_path, store) -> None:
    """Q's KV written under P's key, bound to it (a writer that keyed a request wrongly): intact, bound to the key
    asked for, and still refused, because it records Q's tokens."""
    e = stored(tmp_path, store)
    s = e.connector.scheduler.store
    for mine, theirs in zip(objects(e, P, 1), objects(e, Q, 1)):
        blob = s.get(theirs)
        header = read_header(blob, key=theirs)
        s.put(mine, encode_chunk(decode_payload(blob, header), "raw", key=mine, tokens=header.tokens))
    f = replay(tmp_path, store, P)
    assert f.stats()["load_failures_tokens"] >= 1
    assert f.stats().get("load_failures_corrupt", 0) == 0  # the binding held: only the tokens tell


def test_a_ref_whose_object_is_gone_leads_to_the_tail_under_its_own_prefix(tmp_path, store) -> None:
    """X (90 tokens) stores a 16-token tail in chunk 2, ref'd by itself; Y shares X's first 80 tokens and stores
    chunk 2 whole, whose ref for the same 16-token prefix replaces X's. Y's chunk is evicted, X's tail is not: a
    replay of X loads that tail instead of missing it."""
    x = P[:90]
    y = P[:80] + prompt(40, 5)
    e = Engine(tmp_path, store)
    for name, tokens in (("x", x), ("y", y)):
        e.add(name, tokens, max_tokens=1)
        e.run()
    e.flush()
    for key in objects(e, y, 2):
        e.connector.scheduler.store.delete(key)
    f = replay(tmp_path, store, x)
    assert loaded_tokens(f, "r") == 80
    assert f.scheduler_stats()["refs_to_own_tail"] == 1
    assert f.stats().get("load_failures", 0) == 0
