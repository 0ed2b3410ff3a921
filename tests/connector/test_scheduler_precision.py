"""Lossy precision (LOSSY: NOT BIT-EXACT, opt-in) in vLLM's real Scheduler: what stays exact, and what a load reads.

A lossy level is a key namespace of its own: a lossless engine never finds
its objects, a request that demands lossless on a lossy server reads only
lossless objects and never a lossy block of vLLM's prefix cache, a chunk
holding NaN or inf is stored lossless only, and bad scales are a failed load
that vLLM recomputes. Under ``precision: auto`` a load reads the lossy variant
where the measured link is too slow for its budget (the link emulator,
``link+``), the lossless object where it is fast, and the lossless object
where the variant is missing.

The harness checks every request's context in every step, bit for bit: only a
request the connector knows holds lossy KV from a position on may read other
bits from there (see :mod:`tests.support.scheduler_harness`); KV the fake
model computes over wrong context is itself wrong, so lossy KV stored or
cached as lossless would be caught wherever it is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage import open_store
from tests.support.adversarial import SCALE_DAMAGE, bad_scales_payload
from tests.support.scheduler_harness import Engine, loads_of, prompt, saved_by, true_kv
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.format import build_chunk, decode_chunk, payload_of, read_header
from vllm_kvcodec.keys.chain import Namespace, chunk_hashes, object_key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

P, Q = prompt(100, 1), prompt(100, 2)  # chunks of 32, blocks of 16: 3 full chunks each
EXACT = {"kvcodec_precision": "lossless"}


def namespace(e: Engine, precision: str = "lossless") -> Namespace:
    return e.connector.scheduler.keying.namespace_of(precision)


def objects_of(store: str, ns: Namespace, tokens: list[int], chunk: int) -> list[str]:
    """The keys of chunk ``chunk``'s objects (every layer group) of ``tokens``, keyed in ``ns``'s chain."""
    h = chunk_hashes(ns, tokens, chunk + 1)[chunk]
    return [object_key(ns, h, 0, g) for g in range(len(ns.layer_groups()))]


def in_namespace(store: str, ns: Namespace) -> list[str]:
    with open_store(store) as s:
        return [k for k in s.keys() if k.startswith(f"kvc/{ns.digest[:16]}/")]


def codecs_of(store: str, keys: list[str]) -> list[str | None]:
    with open_store(store) as s:
        return [None if (blob := s.get(k)) is None else read_header(blob).codec_id for k in keys]


def assert_holds_quantised(store: str, key: str, tokens: list[int], chunk: int) -> None:
    """The lossy object under ``key`` holds chunk ``chunk`` of the fake model's KV of ``tokens`` (read out of the
    engine's pages as canonical KV), each value within half a step of its group's range (quantisation's error), not
    other positions' values (a transform gone wrong is off by the whole range)."""
    with open_store(store) as s:
        got = decode_chunk(s.get(key)).float()
    want = torch.stack([true_kv(tokens, chunk * 32, chunk * 32 + 32, layer) for layer in range(got.shape[0])]).float()
    assert got.shape == want.shape  # [layers, 2, tokens, heads, dim]
    span = (want.amax(dim=(2, 3, 4), keepdim=True) - want.amin(dim=(2, 3, 4), keepdim=True))  # per layer, K or V
    assert ((got - want).abs() <= span / 255 / 2 * 1.01 + want.abs() / 128).all()
    assert not torch.equal(got, want), "quantised: not bit-exact"


def read_precisions(e: Engine, req_id: str) -> list[tuple[str, ...]]:
    return [c.precisions for spec in loads_of(e, [req_id]) for c in spec.chunks]


def test_a_lossless_engine_finds_nothing_an_int8_engine_saved(tmp_path, store) -> None:
    lossy = saved_by(tmp_path, store, P, precision="int8")
    assert in_namespace(store, namespace(lossy, "int8")) and not in_namespace(store, namespace(lossy))
    assert_holds_quantised(store, objects_of(store, namespace(lossy, "int8"), P, 1)[0], P, 1)
    f = Engine(tmp_path, store)
    f.add("r", P, max_tokens=1)
    f.run()
    assert f.scheduler_stats().get("hit_chunks", 0) == 0 and not loads_of(f, ["r"])
    f.assert_empty()


@pytest.mark.parametrize("tp", [1, 2])
def test_an_int8_hit_ends_on_a_block_through_the_int8_namespace_s_refs(tmp_path, store, tp) -> None:
    """A prompt sharing P's first 48 tokens (chunk 0 and a block of chunk 1) loads them through a block ref of the
    int8 namespace, on every tensor-parallel rank; a lossless engine finds neither chunks nor refs there."""
    saved_by(tmp_path, store, P, precision="int8", tp=tp)
    shared = P[:48] + prompt(40, 9)
    f = Engine(tmp_path, store, precision="int8", tp=tp)
    f.add("r", shared, max_tokens=1)
    f.run()
    assert sum(c.tokens for spec in loads_of(f, ["r"]) for c in spec.chunks) == 48
    assert read_precisions(f, "r") == [("int8",)] * 2
    assert f.scheduler_stats()["refs_read"] >= 1 and f.stats(tp - 1)["precision_reads_int8"] == 2
    f.assert_empty()
    g = Engine(tmp_path, store, tp=tp)
    g.add("r", shared, max_tokens=1)
    g.run()
    assert not loads_of(g, ["r"]) and g.scheduler_stats().get("refs_read", 0) == 0
    g.assert_empty()


def test_the_first_layers_and_sink_tokens_stay_exact(tmp_path, store) -> None:
    """precision_full_layers 1 and precision_sink_tokens 16: every object keeps layer 0 bit for bit, and only the
    sequence's first chunk keeps its first 16 tokens; the rest is quantised."""
    e = saved_by(tmp_path, store, P, precision="int8", precision_full_layers=1, precision_sink_tokens=16)
    lossy = namespace(e, "int8")
    assert lossy.precision == "int8+sink16+full1"
    with open_store(store) as s:
        blobs = [s.get(objects_of(store, lossy, P, c)[0]) for c in range(2)]
    configs = [read_header(b).codec_config for b in blobs]
    assert configs[0]["sink_tokens"] == 16 and "sink_tokens" not in configs[1]
    assert configs[0]["full_layers"] == configs[1]["full_layers"] == 1
    for c, blob in enumerate(blobs):
        got = decode_chunk(blob).view(torch.int16)
        want = [true_kv(P, 32 * c, 32 * c + 32, layer).view(torch.int16) for layer in range(2)]
        assert torch.equal(got[0], want[0])  # the full layer
        assert torch.equal(got[1, :, :16], want[1][:, :16]) == (c == 0)  # the sink tokens, in the first chunk only
        assert not torch.equal(got[1, :, 16:], want[1][:, 16:])


@pytest.mark.usefixtures("lookup")
def test_a_request_demanding_lossless_on_a_lossy_server_reads_only_lossless_objects(tmp_path, store) -> None:
    """The store holds P lossless (a lossless engine saved it) and int8 (an int8 engine did). On an int8 server a
    request first loads P lossy; then one demanding lossless meets those lossy blocks as its local hit: they are
    evicted from vLLM's prefix cache, and it loads P's lossless objects, bit for bit (the harness checks it)."""
    saved_by(tmp_path, store, P)
    saved_by(tmp_path, store, P, precision="int8")
    f = Engine(tmp_path, store, precision="int8")
    f.add("lossy", P, max_tokens=1)
    f.run()
    assert read_precisions(f, "lossy") == [("int8",)] * 3
    f.add("exact", P + [7], max_tokens=1, kv_transfer_params=EXACT)
    f.run()
    assert read_precisions(f, "exact") == [("lossless",)] * 3
    assert f.scheduler_stats()["lossy_blocks_evicted"] == 6  # 3 chunks of 2 blocks: none left as a local hit
    groups = len(namespace(f).layer_groups())
    assert f.stats()["precision_reads_int8"] == f.stats()["precision_reads_lossless"] == 3 * groups
    f.assert_empty()


@pytest.mark.usefixtures("lookup")
def test_lossless_and_lossy_requests_asked_in_one_step_each_read_their_own_objects(tmp_path, store) -> None:
    """P stored lossless, Q int8: asked in one step (on the lookup thread, in one batch), each request finds its
    prompt in its own namespace."""
    saved_by(tmp_path, store, P)
    saved_by(tmp_path, store, Q, precision="int8")
    f = Engine(tmp_path, store, precision="int8")
    f.add("exact", P, max_tokens=1, kv_transfer_params=EXACT)
    f.add("lossy", Q, max_tokens=1)
    f.run()
    assert read_precisions(f, "exact") == [("lossless",)] * 3
    assert read_precisions(f, "lossy") == [("int8",)] * 3
    f.assert_empty()


def nan_in_chunk_1(tokens: list[int], start: int, stop: int, layer: int, dtype: torch.dtype = torch.bfloat16):
    """The fake model's KV, with NaN and inf at positions 40 and 41 (chunk 1) of layer 0's keys and values."""
    kv = true_kv(tokens, start, stop, layer, dtype)
    for pos, value in ((40, float("nan")), (41, float("inf"))):
        if layer == 0 and start <= pos < stop:
            kv[:, pos - start, 0, 3] = value
    return kv


@pytest.mark.parametrize("precision", ["int8", "auto"])
def test_a_chunk_holding_nan_or_inf_is_saved_lossless_only(tmp_path, store, precision) -> None:
    """int8: chunk 1 is a lossless object in the int8 namespace (a lossy reader decodes it, exactly); auto: it has
    its lossless object and no lossy variant, and a load that wanted the variant reads the lossless one."""
    e = saved_by(tmp_path, store, P, precision=precision, kv_fn=nan_in_chunk_1, precision_load_budget_s=1e-6)
    stats = e.stats()
    assert stats["precision_nonfinite_chunks"] == 1
    lossy = namespace(e, "int8")
    if precision == "int8":
        keys = [objects_of(store, lossy, P, c) for c in range(3)]
        assert [codecs_of(store, k) for k in keys] == [["quantized"], ["raw"], ["quantized"]]
    else:
        ns = namespace(e)
        variant = [[object_key(lossy, k.split("/")[2], 0, 0)] for k in (objects_of(store, ns, P, c)[0] for c in range(3))]
        assert [codecs_of(store, k) for k in variant] == [["quantized"], [None], ["quantized"]]
        assert all(codecs_of(store, objects_of(store, ns, P, c)) == ["raw"] for c in range(3))
    f = Engine(tmp_path, store, precision=precision, kv_fn=nan_in_chunk_1, precision_load_budget_s=1e-6)
    f.add("r", P, max_tokens=1)
    f.run()
    assert f.stats().get("load_failures", 0) == 0
    assert f.stats()["precision_reads_lossless"] == 1  # chunk 1, NaN and inf bits in place (the harness checks)
    assert f.stats()["precision_reads_int8"] == 2
    if precision == "auto":
        assert read_precisions(f, "r") == [("int8", "lossless")] * 3  # the budget asks for the variant
        assert f.stats()["precision_fallbacks"] == 1  # chunk 1 has none: its lossless object, no recompute
    f.assert_empty()


def damaged(blob: bytes, key: str, damage: str) -> bytes:
    """A stored int8 object with bad scales: what a broken or tampering writer leaves (header, key binding, token
    digests and checksum intact, so that only the codec's own checks can catch it)."""
    header = read_header(blob, key=key)
    parts = get_codec(header.codec_config).unpack(payload_of(blob, header), header.dtype, header.shape)
    return build_chunk(bad_scales_payload(parts, damage), header.dtype, header.shape, header.codec_config, key=key,
                       tokens=header.tokens)


@pytest.mark.parametrize("damage", SCALE_DAMAGE)
def test_bad_scales_are_a_failed_load_and_a_recompute(tmp_path, store, damage) -> None:
    """Chunk 0's int8 objects with bad scales: the load fails on them (kind corrupt), vLLM is told their blocks and
    computes the prompt from its first token again; no request reads what they would decode to."""
    e = saved_by(tmp_path, store, P, precision="int8")
    with open_store(store) as s:
        for key in objects_of(store, namespace(e, "int8"), P, 0):
            s.put(key, damaged(s.get(key), key, damage))
    f = Engine(tmp_path, store, precision="int8")
    f.add("r", P, max_tokens=1)
    f.run()
    assert f.stats()["load_failures_corrupt"] == len(namespace(f).layer_groups())
    failed = [step for step in f.steps if step.invalid_blocks]
    assert failed and failed[0].invalid_blocks >= set(f.steps[0].loads[0].chunks[0].block_ids)
    recomputed = [step for step in f.steps[f.steps.index(failed[0]) + 1 :] if step.computed_before.get("r") == 0]
    assert recomputed and recomputed[0].scheduled["r"] >= 99  # from its first token, over the whole prompt
    assert f.scheduler_stats()["failed_load_chunks"] == 1
    f.assert_empty()


def link(tmp_path: Path, gbps: float) -> str:
    return f"link+file://{tmp_path / 'store'}?gbps={gbps}&rtt_ms=0"


#: auto with a 2 ms budget, and one object per chunk whatever the store (a network store would have 2 layer groups).
AUTO = {"precision": "auto", "precision_load_budget_s": 0.002, "layers_per_object": 2}


def test_auto_reads_the_lossy_variant_on_a_slow_link_and_the_lossless_object_on_a_fast_one(tmp_path, store) -> None:
    """An auto engine stored P lossless and as an int8 variant. A fresh auto engine behind an emulated 0.1 Gbit/s
    link cannot bring P's lossless objects within its 2 ms budget: it reads the variant; behind 100 Gbit/s it reads
    the lossless objects (the harness checks them bit for bit); a request with a budget of its own (60 s) reads
    lossless on the slow link too (a fresh engine: the first one's prefix cache holds P)."""
    e = saved_by(tmp_path, store, P, **AUTO)
    ns, lossy = namespace(e), namespace(e, "int8")
    assert len(in_namespace(store, ns)) > 0 and len(in_namespace(store, lossy)) == 3 * len(ns.layer_groups())
    variant = object_key(lossy, chunk_hashes(ns, P, 3)[2], 0, 0)  # under the lossless chain's hash
    assert_holds_quantised(store, variant, P, 2)
    slow = Engine(tmp_path, link(tmp_path, 0.1), **AUTO)
    slow.add("r", P, max_tokens=1)
    slow.run()
    assert read_precisions(slow, "r") == [("int8", "lossless")] * 3
    assert slow.stats()["precision_reads_int8"] == 3 * len(ns.layer_groups())
    slow.assert_empty()
    slow.shutdown()
    patient = Engine(tmp_path, link(tmp_path, 0.1), **AUTO)
    patient.add("r", P, max_tokens=1, kv_transfer_params={"kvcodec_load_budget_s": 60})
    patient.run()
    assert read_precisions(patient, "r") == [("lossless",)] * 3
    patient.assert_empty()
    patient.shutdown()
    fast = Engine(tmp_path, link(tmp_path, 100), **AUTO)
    fast.add("r", P, max_tokens=1)
    fast.run()
    assert read_precisions(fast, "r") == [("lossless",)] * 3
    assert fast.stats().get("precision_reads_int8", 0) == 0
    assert fast.stats()["precision_reads_lossless"] == 3 * len(ns.layer_groups())
    fast.assert_empty()


def test_under_auto_what_a_request_computes_over_lossy_kv_is_not_saved(tmp_path, store) -> None:
    """A request that read P's variant goes on to compute two more chunks: they rest on lossy KV, so they are not
    saved (a lossless object is the ground truth); a lossless engine then computes them itself."""
    saved_by(tmp_path, store, P, **AUTO)
    longer = P[:96] + prompt(70, 5)
    slow = Engine(tmp_path, link(tmp_path, 0.1), **AUTO)
    slow.add("r", longer, max_tokens=1)
    slow.run()
    assert read_precisions(slow, "r")[0] == ("int8", "lossless")
    assert slow.scheduler_stats()["saves_skipped_lossy_kv"] >= 2
    slow.flush()
    slow.assert_empty()
    slow.shutdown()
    exact = Engine(tmp_path, store)
    exact.add("r", longer, max_tokens=1)
    exact.run()
    assert sum(c.tokens for spec in loads_of(exact, ["r"]) for c in spec.chunks) == 96  # P's chunks, no more
    exact.assert_empty()
