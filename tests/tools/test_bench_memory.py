"""`bench memory` drives the real Saver and Fetcher over a CPU_ATTN paged cache; its load must be bit-exact.

The memory figures themselves are benchmark output (docs/benchmarks.md), not
asserted here; this checks the harness measures what it says: every chunk
saved, every object loaded, every token back bit-exactly, the peak mark reset.
"""

from __future__ import annotations

import json


def test_bench_memory_saves_and_loads_a_prefix_bit_exactly(tmp_path) -> None:
    from vllm_kvcodec.tools.bench import memory

    out = tmp_path / "memory.json"
    result = memory.run(out, tokens=4096, codecs=["raw"])
    assert json.loads(out.read_text())["results"] == result["results"]
    save, load = result["results"]
    assert save["phase"] == "save" and load["phase"] == "load"
    assert save["stats"]["saved_chunks"] == 4096 // memory.CHUNK_TOKENS
    assert load["stats"]["loaded_objects"] == save["stats"]["saved_objects"] == 16 * 6
    assert load["bit_exact"] and load["failed_blocks"] == 0
    assert save["peak_reset"] and load["peak_reset"]
    assert save["growth_bytes"] > 0 and load["growth_bytes"] >= 0
