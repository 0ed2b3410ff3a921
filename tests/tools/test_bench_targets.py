"""bench ttft's targets read from its rows: auto is judged by its TTFT and, apart, by the codec it chose."""

from __future__ import annotations

from vllm_kvcodec.tools.bench.ttft import _targets


def row(codec: str, gbps: float, over_local: float, saved: str | None = None) -> dict:
    return {"codec": codec, "gbps": gbps, "over_local": over_local, "ttft_s": over_local / 10, "full_hit": True,
            "save": {"codecs": saved or codec}}


def test_auto_is_judged_on_its_own_row_and_on_the_fixed_row_of_its_choice() -> None:
    rows = [row("raw", 10, 1.40), row("splitzip", 10, 1.20), row("zstd", 10, 1.26), row("auto", 10, 1.50, "zstd")]
    targets = _targets(rows, {}, [10.0])
    own = targets["TTFT(auto) / TTFT(best fixed=splitzip) at 10 Gbit/s"]
    assert abs(own["value"] - 1.25) < 1e-9 and not own["met"]
    choice = targets["TTFT(zstd: auto's choice) / TTFT(best fixed=splitzip) at 10 Gbit/s"]
    assert abs(choice["value"] - 1.05) < 1e-9 and choice["met"]
    best = targets["TTFT(best=splitzip) / TTFT(raw) at 10 Gbit/s"]
    assert abs(best["value"] - 1.20 / 1.40) < 1e-9 and not best["met"]


def test_a_mixed_choice_has_no_fixed_row_to_compare() -> None:
    rows = [row("raw", 100, 1.2), row("auto", 100, 1.3, "raw, splitzip")]
    assert not any("auto's choice" in k for k in _targets(rows, {}, [100.0]))
