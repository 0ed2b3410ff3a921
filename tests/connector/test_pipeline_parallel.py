"""Pipeline parallelism: each stage saves and loads its own layers, under keys no other stage uses.

vLLM splits the layers between stages (``get_pp_indices``); each stage's
worker registers only its own KV caches. The namespace names the stages
(``pp_layers``), layer groups never straddle a stage and are numbered across
stages, so stage 1's first group is ``g<first>`` after stage 0's last; a
chunk is found only when every stage's every object is stored. Checked here
at the key level and through the real connector's scheduler half built from
real vLLM configs; ``test_connector_pp_engine.py`` runs it on a real engine.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.parallel_configs import matched, put, scheduler_connector
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses, chunk_hashes, chunk_object_keys, object_key

TOKENS = list(range(2000, 2000 + 520))
FIVE = Namespace("llama#x", "bfloat16", 5, 2, 32, "pages-bs16-v1", 1, 256, 2, pp_layers="3,2")


def test_groups_never_straddle_a_stage_and_are_numbered_across_stages() -> None:
    assert FIVE.stages() == [range(0, 3), range(3, 5)]
    assert FIVE.layer_groups() == [range(0, 2), range(2, 3), range(3, 5)]
    assert FIVE.stage_groups(0) == (0, [range(0, 2), range(2, 3)])
    assert FIVE.stage_groups(1) == (2, [range(0, 2)])  # stage 1's layers 3-4 are its caches 0-1


def test_each_stage_writes_its_own_groups_and_only_the_first_stage_writes_refs() -> None:
    h = chunk_hashes(FIVE, TOKENS, 1)[0]
    stage0 = ObjectAddresses(FIVE, 0, tuple(FIVE.stage_groups(0)[1]), 0)
    stage1 = ObjectAddresses(FIVE, 0, tuple(FIVE.stage_groups(1)[1]), FIVE.stage_groups(1)[0])
    mine = [stage0.key(h, g) for g in range(2)] + [stage1.key(h, 0)]
    assert mine == chunk_object_keys(FIVE, h, 1, 3), "the stages' keys are exactly the chunk's objects, none twice"
    assert stage0.writes_refs and not stage1.writes_refs
    assert not ObjectAddresses(FIVE, 1, (), 0).writes_refs  # a second TP rank of stage 0 neither


def test_stages_are_in_the_digest_and_one_stage_keeps_its_digest() -> None:
    one = dataclasses.replace(FIVE, pp_layers="")
    assert one.digest != FIVE.digest != dataclasses.replace(FIVE, pp_layers="2,3").digest
    from tests.connector.test_isolation import BASE_DIGEST

    base = Namespace("m#1", "bfloat16", 30, 3, 64, "canonical-v1", 1, 128, 5)
    assert base.digest == BASE_DIGEST


def test_stages_must_add_up_to_the_layers() -> None:
    with pytest.raises(ValueError, match="do not make 5"):
        dataclasses.replace(FIVE, pp_layers="3,3").stages()


# ---- the scheduler half, from real vLLM configs ----------------------------------------------------------------
def test_the_scheduler_keys_every_stages_layers(tmp_path) -> None:
    """The scheduler process is stage 0's (its KV cache config names stage 0's layers only), yet its namespace
    is the whole model's: 5 layers in stages of 3 and 2 (vLLM's split), 2 per object -> 3 groups."""
    conn = scheduler_connector(tmp_path, "llama", 1, f"file://{tmp_path / 'store'}", pp=2, layers=5,
                               layers_per_object=2)
    ns = conn.scheduler.namespace
    assert (ns.num_layers, ns.pp_layers, ns.layers_per_object, conn.scheduler.groups) == (5, "3,2", 2, 3)
    assert ns.attention == ""


def test_a_chunk_one_stage_lacks_is_a_miss(tmp_path) -> None:
    url = f"file://{tmp_path / 'store'}"
    conn = scheduler_connector(tmp_path, "llama", 2, url, pp=2, layers=5, layers_per_object=2)
    ns = conn.scheduler.namespace
    hashes = chunk_hashes(ns, TOKENS, 2)
    put(url, [object_key(ns, h, r, g) for h in hashes for r in range(2) for g in range(2)])  # stage 0's objects
    assert matched(conn, TOKENS) == 0, "stage 1's objects are missing"
    put(url, [object_key(ns, hashes[0], r, 2) for r in range(2)])
    assert matched(conn, TOKENS) == 256
    put(url, [object_key(ns, hashes[1], 0, 2)])  # stage 1, rank 1's object still missing
    assert matched(conn, TOKENS) == 256
    put(url, [object_key(ns, hashes[1], 1, 2)])
    assert matched(conn, TOKENS) == 512


def test_mla_with_pipeline_parallelism_keys_the_whole_models_latent(tmp_path) -> None:
    conn = scheduler_connector(tmp_path, "dsv2", 1, f"file://{tmp_path / 'store'}", pp=2)
    ns = conn.scheduler.namespace
    assert (ns.num_layers, ns.pp_layers, ns.attention) == (2, "1,1", "latent,latent")
    assert conn.scheduler.groups == 2  # one group per stage: no object holds two stages' layers


def test_an_fp8_cache_with_pipeline_parallelism_is_refused_with_the_reason(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2\) for bf16/fp16 caches .* not an fp8 KV cache"):
        scheduler_connector(tmp_path, "llama", 1, f"file://{tmp_path / 'store'}", pp=2, cache_dtype="fp8")


def test_every_stages_workers_must_key_the_schedulers_namespace(tmp_path) -> None:
    """vLLM hands the scheduler every worker's handshake keyed by (stage, rank): all are checked, stage 1's too."""
    from vllm_kvcodec.connector.cache_identity import KVCodecHandshake

    conn = scheduler_connector(tmp_path, "llama", 1, f"file://{tmp_path / 'store'}", pp=2, layers=5)
    digest = conn.scheduler.namespace.digest
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): KVCodecHandshake("", digest), (1, 0): KVCodecHandshake("", digest)})
    with pytest.raises(ConfigError, match="configurations differ"):
        conn.set_xfer_handshake_metadata_pp_aware({(0, 0): KVCodecHandshake("", digest),
                                                   (1, 0): KVCodecHandshake("", "0" * 32)})


def test_kv_events_wait_for_every_saving_worker() -> None:
    """A chunk is announced once every worker that writes it reported: each stage's ranks, or each stage's rank 0
    for a replicated latent (its other ranks only load, and report no save)."""
    from vllm_kvcodec.connector.parallel_ranks import saving_workers

    assert saving_workers(FIVE) == 2
    assert saving_workers(dataclasses.replace(FIVE, tp_size=2)) == 4
    assert saving_workers(dataclasses.replace(FIVE, tp_size=2, kv_replicated=True)) == 2
    assert saving_workers(dataclasses.replace(FIVE, tp_size=2, kv_replicated=True, pp_layers="")) == 1


@pytest.mark.parametrize("model,tp,pp,loaders", [("llama", 2, 2, 4), ("dsv2", 2, 1, 2)])
def test_a_load_is_settled_once_every_stages_every_rank_reported(tmp_path, model, tp, pp, loaders) -> None:
    """Every worker runs every load and reports it, as vLLM's KVOutputAggregator counts them (its world size):
    each stage's ranks, and a replicated latent's ranks too (rank 0 alone saves it, all of them load it)."""
    conn = scheduler_connector(tmp_path, model, tp, f"file://{tmp_path / 'store'}", pp=pp,
                               **({"layers": 4} if model == "llama" else {}))
    assert conn.scheduler.ledger.loaders == loaders == conn._vllm_config.parallel_config.world_size
