"""Chunks written by an earlier build still decode, bit for bit (tests/data/golden, see vllm_kvcodec/tools/golden.py).

A store outlives the build that filled it: a change to the container, a codec's
payload or its config that can no longer read these files must fail here, and
must come with a new format version (and new golden files) instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvcodec.format import decode_chunk, read_header
from vllm_kvcodec.tools.golden import CASES, bits_digest

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def test_every_codec_and_dtype_has_a_golden_chunk() -> None:
    assert {f"{stem}.v1.kvcz" for stem, _, _ in CASES} <= set(MANIFEST)
    assert {entry["codec"]["id"] for entry in MANIFEST.values()} == {"raw", "zstd", "splitzip", "rans", "video"}


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_chunk_decodes_bit_exactly(name: str) -> None:
    if MANIFEST[name]["codec"]["id"] == "video":
        pytest.importorskip("av", reason="the video codec needs PyAV (pip install 'vllm-kvcodec[video]')")
    entry = MANIFEST[name]
    blob = (GOLDEN / name).read_bytes()
    header = read_header(blob, key=entry["key"])  # still key-bound to the key it was written for
    assert header.codec_config == entry["codec"] and list(header.shape) == entry["shape"]
    kv = decode_chunk(blob, key=entry["key"])
    assert str(kv.dtype).removeprefix("torch.") == entry["dtype"]
    assert bits_digest(kv) == entry["bits_sha256"]
