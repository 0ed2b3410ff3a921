"""The trace simulator's rules, each on a few requests worked out by hand (64 tokens per id, blocks of 32, chunks of 64).

The engine-level check (the simulator against a real replay, request by
request) is in test_bench_trace.py.
"""

from __future__ import annotations

import pytest

from vllm_kvcodec.tools.bench.trace_file import TraceRequest
from vllm_kvcodec.tools.bench.trace_model import CostModel, break_even_gbps, measured_codecs, model_spec
from vllm_kvcodec.tools.bench.trace_sim import FleetSpec, block_keys, simulate

SMALL = model_spec("smollm2-135m")
RAW = CostModel(SMALL, measured_codecs()["raw"])
CHUNK_BYTES = 64 * SMALL.kv_bytes_per_token  # one raw chunk


def req(i: int, ids: tuple[int, ...], length: int | None = None, ts: float | None = None) -> TraceRequest:
    return TraceRequest(i, float(i if ts is None else ts), length or 64 * len(ids), 1, ids)


def fleet(**kw) -> FleetSpec:
    base = dict(workers=2, tokens_per_id=64, block_tokens=32, chunk_tokens=64, local_tokens=10_000)
    return FleetSpec(**{**base, **kw})


def splits(result) -> list[tuple[int, int, int]]:
    return [(r["local"], r["store"], r["computed"]) for r in result["per_request"]]


def run(requests, cost=RAW, **kw):
    routing = kw.pop("routing", None)
    return simulate(requests, fleet(**kw), cost, routing=routing, per_request=True)


def test_block_keys_chain_the_pieces_vllms_client_makes() -> None:
    a, la = block_keys(req(0, (0, 1, 2)), 64, 32)
    b, lb = block_keys(req(1, (0, 1, 3)), 64, 32)
    c, lc = block_keys(req(2, (9, 1, 2)), 64, 32)
    d, ld = block_keys(req(3, (0, 1, 2), length=170), 64, 32)  # last piece 42 tokens: another piece
    assert (la, lb, lc, ld) == (192, 192, 192, 170) and len(d) == 5
    assert a[:4] == b[:4] and a[4] != b[4]
    assert not set(a) & set(c)  # the same ids after another first id: other tokens
    assert d[:4] == a[:4] and d[4] != a[4]
    e, _ = block_keys(req(4, (0, 1, 2)), 64, 48)  # blocks straddling pieces
    f, _ = block_keys(req(5, (0, 1, 7)), 64, 48)
    assert len(e) == 4 and e[:2] == f[:2] and e[2] != f[2]  # block 2 holds tokens 96-144: ids 1 and 2


def test_the_store_serves_other_workers_and_the_local_cache_its_own() -> None:
    rows = [req(0, (0, 1, 2)), req(1, (0, 1, 3)), req(2, (0, 1, 2)), req(3, (0, 1, 2), length=170)]
    result = run(rows)
    assert [r["worker"] for r in result["per_request"]] == [0, 1, 0, 1]  # round robin
    # 1: chunks 0-1 from the store (saved by 0 on the other worker); 2: its own worker's cache, up to the block
    # before its last token's; 3: a short last piece is other tokens, so only ids 0-1, from its worker's cache
    assert splits(result) == [(0, 0, 192), (0, 128, 64), (160, 0, 32), (128, 0, 42)]
    assert result["shares"] == pytest.approx({"local": 288 / 746, "store": 128 / 746, "computed": 330 / 746})
    without = run(rows, connector=False)
    assert splits(without) == [(0, 0, 192), (0, 0, 192), (160, 0, 32), (128, 0, 42)]
    assert without["store"]["stored_bytes"] == 0


def test_a_prompt_tail_is_served_through_its_block_ref() -> None:
    # 100 tokens: chunk 0 (blocks 0-1), then a tail of one whole block (2) past it; 4 tokens in no whole block
    result = run([req(0, (0, 1), length=100), req(1, (0, 1), length=100)])
    assert splits(result) == [(0, 0, 100), (0, 96, 4)]
    assert result["store"]["objects"] == 2  # the chunk and the tail (the finishing tail is the same blocks)


def test_longest_prefix_routes_to_the_worker_holding_it() -> None:
    rows = [req(0, (0, 1)), req(1, (5, 6)), req(2, (5, 6, 8)), req(3, (0, 1, 7))]
    result = run(rows, policy="longest_prefix", balance_s=1e9, connector=False)
    assert [r["worker"] for r in result["per_request"]] == [0, 1, 1, 0]  # 0 and 1: a tie, to the one given fewer
    assert splits(result)[2:] == [(128, 0, 64), (128, 0, 64)]
    rr = run(rows, connector=False)
    assert [r["worker"] for r in rr["per_request"]] == [0, 1, 0, 1]
    assert splits(rr)[2:] == [(0, 0, 192), (0, 0, 192)]


def test_given_routing_is_followed() -> None:
    result = run([req(0, (0, 1)), req(1, (0, 1, 2))], routing=[1, 1], connector=False)
    assert [r["worker"] for r in result["per_request"]] == [1, 1]
    assert splits(result)[1] == (128, 0, 64)  # 0's four blocks, on the worker given


def test_the_local_cache_evicts_a_requests_last_blocks_first() -> None:
    # 4 blocks of capacity; 0 leaves blocks 0-5 (its answer token adds no whole block): 4 and 5 are evicted
    result = run([req(0, (0, 1, 2)), req(1, (0, 1, 2))], workers=1, local_tokens=128, connector=False)
    assert splits(result) == [(0, 0, 192), (128, 0, 64)]


def test_a_bounded_store_evicts_least_recently_used_objects() -> None:
    rows = [req(0, (0, 1, 2)), req(1, (5, 6, 7)), req(2, (0, 1, 2))]
    kw = dict(workers=3, local_tokens=0)
    assert splits(run(rows, **kw))[2] == (0, 160, 32)
    bounded = run(rows, store_bytes=3 * CHUNK_BYTES, **kw)  # 1's three chunks push out 0's
    assert splits(bounded)[2] == (0, 0, 192)
    assert bounded["store"]["evictions"] == 6 and bounded["store"]["bytes"] <= 3 * CHUNK_BYTES
    # 4 raw chunks of room: raw still loses 0's first two chunks (the least recently used); at rans's ratio
    # (1.51x) all six chunks fit
    assert splits(run(rows, store_bytes=4 * CHUNK_BYTES, **kw))[2] == (0, 0, 192)
    rans = run(rows, cost=CostModel(SMALL, measured_codecs()["rans"]), store_bytes=4 * CHUNK_BYTES, **kw)
    assert splits(rans)[2] == (0, 160, 32) and rans["store"]["evictions"] == 0


def test_a_near_tier_serves_its_own_worker_without_far_reads() -> None:
    rows = [req(0, (0, 1, 2)), req(1, (0, 1, 2))]
    one = run(rows, workers=1, local_tokens=0, near_bytes=10 * CHUNK_BYTES)
    assert splits(one)[1] == (0, 160, 32)
    assert one["per_request"][1]["far_bytes"] == 0 and one["per_request"][1]["near_bytes"] == 3 * CHUNK_BYTES
    two = run(rows, workers=2, local_tokens=0, near_bytes=10 * CHUNK_BYTES)  # the other worker's near tier is empty
    assert two["per_request"][1]["far_bytes"] == 3 * CHUNK_BYTES and two["per_request"][1]["near_bytes"] == 0


def test_the_cost_model_prices_prefill_loads_and_queues() -> None:
    m = model_spec("llama-70b")
    assert m.kv_bytes_per_token == 320 * 1024
    assert m.prefill_s(100, 50) == pytest.approx(m.s_per_token * 100 + m.s_per_token2 * (150**2 - 50**2) / 2)
    raw = CostModel(m, measured_codecs()["raw"], link_gbps=100)
    assert raw.load_s(12_500_000_000, 0, 0) == pytest.approx(1.0)  # 100 Gbit/s is 12.5 GB/s
    assert break_even_gbps(raw, 8192) == pytest.approx(8192 * m.kv_bytes_per_token * 8 / m.prefill_s(8192, 0) / 1e9)
    # two requests at once on one worker: the second waits for the first's prefill
    rows = [req(0, (0, 1), ts=0), req(1, (5, 6), ts=0)]
    r = simulate(rows, fleet(workers=1, connector=False), CostModel(SMALL, measured_codecs()["raw"]))
    one = SMALL.prefill_s(128, 0)
    assert r["ttft_s"]["mean"] == pytest.approx((one + 2 * one) / 2)
    assert r["prefill_gpu_s"]["saved"] == 0


def test_bad_fleets_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="chunk_tokens .* multiple of block_tokens"):
        fleet(chunk_tokens=50).check()
    with pytest.raises(ValueError, match="unknown routing policy"):
        fleet(policy="random").check()
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("gpt-5")


def test_costs_fitted_through_the_queue_recover_the_costs_that_made_the_ttfts() -> None:
    """TTFTs made by the simulator's own queue from known costs (a loaded fleet: most of TTFT is waiting):
    the fit finds those costs again, and its model reproduces the TTFTs."""
    import random

    from vllm_kvcodec.tools.bench.trace_fit import fit_costs, ttft_error
    from vllm_kvcodec.tools.bench.trace_sim import queue_ttft

    rng = random.Random(5)
    n = 300
    arrivals = sorted(rng.uniform(0, 300) for _ in range(n))  # busy, not saturated
    workers = [i % 2 for i in range(n)]
    computed = [rng.randint(16, 2000) for _ in range(n)]
    cached = [rng.choice([0, 0, 256, 1024]) for _ in range(n)]
    attention = [((c + k) ** 2 - c**2) / 2 for k, c in zip(computed, cached)]
    true = (0.2, 4e-4, 8e-7)
    services = [true[1] * k + true[2] * a for k, a in zip(computed, attention)]
    ttfts = queue_ttft(arrivals, workers, services, 2, true[0])
    assert ttfts.mean() > 1.3 * (true[0] + sum(services) / n)  # waiting is a good part of it
    fit = fit_costs(arrivals, workers, computed, cached, list(ttfts), 2)
    assert fit["overhead_s"] == pytest.approx(true[0], rel=0.1)
    assert fit["s_per_token"] == pytest.approx(true[1], rel=0.1)
    assert fit["s_per_token2"] == pytest.approx(true[2], rel=0.1)
    model = queue_ttft(arrivals, workers, [fit["s_per_token"] * k + fit["s_per_token2"] * a
                                           for k, a in zip(computed, attention)], 2, fit["overhead_s"])
    error = ttft_error(model, ttfts)
    assert abs(error["p50_error"]) < 0.05 and error["median_relative_error"] < 0.05
