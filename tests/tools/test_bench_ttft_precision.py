"""bench ttft's precision rows (LOSSY: NOT BIT-EXACT): lossy rows really read lossy objects through a real engine,
the paper's links are scaled by the stated formula, and each level's crossover follows from its rows."""

from __future__ import annotations

import json

import pytest

from tests.tools.test_cli import kvcodec
from vllm_kvcodec.codecs.precision import LOSSY_LABEL
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.bench import ttft_precision


@pytest.mark.engine
def test_lossy_rows_read_lossy_objects_and_lossless_rows_none(tmp_path) -> None:
    out = tmp_path / "ttft.json"
    args = ["--precision", "lossless,int8", "--codec", "rans", "--paper-gbps", "16", "--prefix-tokens", "512",
            "--suffix-tokens", "16", "--repeats", "1", "--no-replay"]
    done = kvcodec("bench", "ttft", *args, "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["codec"]: r for r in result["results"]}
    assert set(rows) == {"rans", "int8"}
    rans, int8 = rows["rans"], rows["int8"]
    assert rans["full_hit"] and int8["full_hit"] and rans["load_failures"] == int8["load_failures"] == 0
    # the lossless row read lossless objects only; the int8 row int8 objects only, which are smaller
    assert rans["precision"] == "lossless" and rans["precision_reads"]["lossless"] > 0 and "int8" not in rans["precision_reads"]
    assert int8["precision"] == "int8" and set(int8["precision_reads"]) == {"int8"}
    assert int8["loaded_bytes"] < rans["loaded_bytes"] and int8["ratio"] > 1.9
    assert int8["label"] == f"int8 ({LOSSY_LABEL})" and rans["label"] == "rans"
    assert LOSSY_LABEL in done.stdout
    # one link: the paper's 16 Gbit/s scaled by this run's fastest recompute
    p = result["precision"]
    scale = p["scaling"]
    host_tok_s = (512 + 16) / min(result["baseline"]["recompute_all_s"])
    assert scale["host_prefill_tok_s"] == pytest.approx(host_tok_s) and scale["host_kv_bytes_per_token"] == 23040
    (link,) = scale["links"]
    assert link["paper_gbps"] == 16 and rans["gbps"] == int8["gbps"] == link["host_gbps"]
    assert link["host_gbps"] == pytest.approx(16 * scale["factor"], rel=5e-3)  # to 3 significant digits
    assert p["label"] == LOSSY_LABEL and set(p["crossover"]) == {"int8"} and "vs_rans" in p["crossover"]["int8"]
    assert p["speedup_at_paper_16"]["host_gbps"] == link["host_gbps"]
    assert p["speedup_at_paper_16"]["KVCodec, as reported (Yi-34B on their GPUs, not measured here)"] == 3.51


def test_the_paper_links_keep_raw_transfer_over_prefill_time() -> None:
    scale = ttft_precision.scaling(3000.0, 23040, None, [1.0, 16.0])
    paper_tok_s = 148e12 * 0.5 / (2 * 34.4e9)  # Yi-34B on an H20 at 50 % MFU
    assert scale["paper_prefill_tok_s"] == pytest.approx(paper_tok_s) and "estimated" in scale["paper_prefill_tok_s_source"]
    assert scale["paper"]["kv_bytes_per_token"] == 60 * 8 * 128 * 2 * 2
    for link in scale["links"]:
        # 2048 tokens of raw KV over the link, in prefills of 2048 tokens: the same here as in the paper's setting
        here = 2048 * 23040 * 8 / (link["host_gbps"] * 1e9) / (2048 / 3000.0)
        there = 2048 * 245760 * 8 / (link["paper_gbps"] * 1e9) / (2048 / paper_tok_s)
        assert here == pytest.approx(there, rel=5e-3)  # the links are rounded to 3 significant digits
    given = ttft_precision.scaling(3000.0, 23040, 2000.0, [16.0])
    assert given["paper_prefill_tok_s"] == 2000.0 and given["factor"] == pytest.approx(3000 * 23040 / (2000 * 245760))


def _rows(name: str, precision: str, t_fixed: float, nbytes: int, links: list[float]) -> list[dict]:
    """Rows whose fastest TTFT is exactly t_fixed + wire time; the others were stalled by other processes."""
    return [{"codec": name, "precision": precision, "gbps": g, "full_hit": True, "loaded_bytes": nbytes,
             "decode_s": t_fixed / 4, "scatter_s": 0.0, "ttft_all_s": [t + 3.0, t, t + 0.5]}
            for g in links for t in [t_fixed + 8 * nbytes / (g * 1e9)]]


def test_crossover_is_where_fewer_bytes_stop_paying_for_a_slower_decode() -> None:
    scale = ttft_precision.scaling(3000.0, 23040, None, [1.0, 4.0, 16.0, 40.0])
    links = [link["host_gbps"] for link in scale["links"]]
    assert links == [0.261, 1.05, 4.18, 10.5]
    rows = (_rows("raw", "lossless", 0.10, 47_000_000, links) + _rows("rans", "lossless", 0.15, 31_000_000, links)
            + _rows("int4", "int4", 0.25, 11_500_000, links) + _rows("int8", "int8", 0.09, 23_000_000, links))
    p = ttft_precision.summarize(rows, scale)
    assert p["fits"]["int4"]["t_fixed_s"] == pytest.approx(0.25) and p["fits"]["int4"]["max_abs_residual_s"] < 1e-9
    int4 = p["crossover"]["int4"]
    assert int4["label"] == f"int4 ({LOSSY_LABEL})"
    # 0.25 + 8 * 11.5e6 / B = 0.10 + 8 * 47e6 / B  ->  B = 8 * 35.5e6 / 0.15 bit/s
    assert int4["vs_raw"]["modelled_below_gbps"] == pytest.approx(8 * 35.5e6 / 0.15 / 1e9)
    assert int4["vs_raw"]["modelled_below_paper_gbps"] == pytest.approx(8 * 35.5e6 / 0.15 / 1e9 / scale["factor"])
    assert int4["vs_rans"]["modelled_below_gbps"] == pytest.approx(8 * 19.5e6 / 0.10 / 1e9)
    # measured: faster than raw at 0.261 and 1.05 Gbit/s (the crossing is at 1.893), not at 4.18
    assert int4["vs_raw"]["measured"] == {"faster_at_gbps": [0.261, 1.05], "faster_up_to_gbps": 1.05, "slower_from_gbps": 4.18}
    # fewer bytes and a faster start: int8 pays at every bandwidth
    assert p["crossover"]["int8"]["vs_raw"]["modelled"] == "always"
    assert p["crossover"]["int8"]["vs_raw"]["modelled_below_gbps"] is None
    assert p["crossover"]["int8"]["vs_raw"]["measured"]["slower_from_gbps"] is None
    # the speed-up over raw reuse at the link standing for the paper's 16 Gbit/s
    at16 = p["speedup_at_paper_16"]
    assert at16["host_gbps"] == 4.18 and at16["raw"] == pytest.approx(1.0)
    assert at16[f"int4 ({LOSSY_LABEL})"] == pytest.approx((0.10 + 8 * 47e6 / 4.18e9) / (0.25 + 8 * 11.5e6 / 4.18e9))


def test_unknown_precision_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="'int9' is not one of lossless, int8, int6, int4"):
        ttft_precision.parse_levels(["lossless,int9"])
    assert ttft_precision.parse_levels(["lossless,int8", "int4", "int8"]) == ["lossless", "int8", "int4"]
    done = kvcodec("bench", "ttft", "--precision", "int8", "--replay-only")
    assert done.returncode == 2 and done.stderr.startswith("error: --replay-only") and len(done.stderr.splitlines()) == 1
