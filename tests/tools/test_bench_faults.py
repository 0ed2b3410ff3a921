"""The faults bench can tell a wrong load from a right one, and finds none on the connector's load path."""

from __future__ import annotations

import pytest

from vllm_kvcodec.load import fetcher
from vllm_kvcodec.tools.bench import faults
from vllm_kvcodec.format import read_header


@pytest.mark.parametrize("decode_threads", [None, 1], ids=["fetch-threads-decode", "one-decode-thread"])
def test_every_load_is_exact_or_reported_failed_and_every_fault_is_counted(decode_threads) -> None:
    """With the fetch threads decoding, and with one decode thread behind four fetch threads (a CPU engine's default)."""
    result = faults.run(None, faulty_loads=40, seed=2, rates={"delay": 0.02}, timeout_s=0.2, delay_s=0.3,
                        decode_threads=decode_threads)
    assert result["decode_threads"] == decode_threads
    injected = result["injected"]
    assert result["wrong"] == 0 and result["faulty_loads"] >= 40
    assert result["exact"] + result["failed"] == result["loads"] and result["exact"] > 0
    assert all(injected[k] > 0 for k in ("drop", "truncate", "corrupt", "swap", "delay")), injected
    # each non-delay fault fails its object; objects read after a timeout fail too
    assert result["connector"]["load_failures"] >= sum(injected[k] for k in ("drop", "truncate", "corrupt", "swap"))
    assert result["timeouts"] >= 1


def test_a_reader_that_ignores_the_key_binding_loads_swapped_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why chunks are key-bound: without the check, swapped objects pass every other test and load wrong KV."""
    monkeypatch.setattr(fetcher, "read_header", lambda blob, key=None: read_header(blob))
    only_swaps = {"drop": 0.0, "truncate": 0.0, "corrupt": 0.0, "delay": 0.0, "swap": 0.3}
    result = faults.run(None, faulty_loads=10, seed=2, rates=only_swaps)
    assert result["wrong"] > 0 and result["injected"]["swap"] > 0
