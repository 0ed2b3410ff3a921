"""`bench layouts` codes the very integers the quantized codec stores, in KVCodec's frame layout among others.

The figures are benchmark output (docs/codec-video.md), not asserted here;
this checks the harness measures what it says: the rANS candidate is the
codec's own stored chunk (same bytes, so the same ratio), its integers round
trip bit-exactly, and the paper layout puts layer ``3g + p`` of token ``t`` in
plane ``p`` of picture ``t``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from vllm_kvcodec.tools.bench.layouts import paper_frames, paper_integers


@pytest.mark.parametrize("min_side", [8, 144])
def test_the_paper_layout_is_one_picture_per_token_with_three_adjacent_layers_in_its_planes(min_side) -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, size=(31, 2, 5, 3, 64), dtype=np.uint8)  # 31 layers: the last group is padded
    frames = paper_frames(q, min_side)
    assert frames.shape == (5, 3, max(min_side, 72), max(min_side, 64))  # 11 groups x (K, V) x 3 heads = 66 rows
    group, plane, kv, token, head = 4, 1, 1, 2, 2
    row = (group * 2 + kv) * 3 + head
    assert np.array_equal(frames[token, plane, row, :64], q[3 * group + plane, kv, token, head])
    assert np.array_equal(paper_integers(frames, q.shape), q)


def test_bench_layouts_writes_json_and_its_rans_candidate_is_the_codecs_own_chunk(tmp_path) -> None:
    from vllm_kvcodec.format import encode_chunk
    from vllm_kvcodec.tools.smollm2 import real_kv

    out = tmp_path / "layouts.json"
    done = subprocess.run([sys.executable, "-m", "vllm_kvcodec.tools.cli", "bench", "layouts", "--precision", "int8",
                           "--tokens", "256", "--repeats", "1", "--candidate", "rans", "--candidate", "hevc paper",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "layouts" and result["label"] == "lossy: not bit-exact"
    level = result["precisions"]["int8"]
    assert {"entropy_bits", "shared", "results", "winner", "densest"} <= level.keys()
    rows = {r["name"]: r for r in level["results"]}
    assert set(rows) == {"rans", "hevc paper"}
    for row in rows.values():
        assert {"bits_per_value", "ratio", "encode_MBps", "decode_MBps", "chunk_encode_MBps", "chunk_decode_MBps",
                "bit_exact", "load_s_per_GB"} <= row.keys()
    assert rows["rans"]["bit_exact"]
    chunk = real_kv(256)  # the bench's one chunk
    assert rows["rans"]["ratio"] == chunk.numel() * 2 / len(encode_chunk(chunk, precision="int8"))
    assert result["winner"]["int8"] in rows
