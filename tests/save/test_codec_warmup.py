"""The first load of a fresh process compiles nothing: warm_up (run while the engine starts) compiled every kernel a load uses.

A fresh process with an empty numba cache (``NUMBA_CACHE_DIR`` a new empty
directory, as in a new container with a read-only install) runs ``warm_up``,
notes every numba dispatcher's compiled signatures, then encodes and decodes
chunks shaped as the connector stores them (canonical KV, and 5-D page objects
with rans told that the innermost axis is the channel one) and checks that no
dispatcher compiled anything more: nothing is left to compile on a request's
path. How long the first load takes is measured by ``kvcodec bench ttft``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, torch
import numba.core.registry
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.save.codec_warmup import warm_up
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.codecs.into_pages import PageExtents
from vllm_kvcodec.format import decode_chunk, decode_payload_into, encode_chunk, read_header
import vllm_kvcodec.codecs.into_pages, vllm_kvcodec.codecs.rans, vllm_kvcodec.codecs.rans_kernels
import vllm_kvcodec.codecs.splitzip_kernels

def dispatchers():
    mods = [vllm_kvcodec.codecs.into_pages, vllm_kvcodec.codecs.rans, vllm_kvcodec.codecs.rans_kernels,
            vllm_kvcodec.codecs.splitzip_kernels]
    return {f"{m.__name__}.{n}": f for m in mods for n, f in vars(m).items()
            if isinstance(f, numba.core.registry.CPUDispatcher)}

dtype = getattr(torch, sys.argv[1])
warm_up(dtype)
before = {n: len(f.signatures) for n, f in dispatchers().items()}
g = torch.Generator().manual_seed(1)
canonical = (torch.randn((6, 2, 256, 3, 64), generator=g) * 0.7).to(dtype)
pages = (torch.randn((6, 2, 3, 2, 64, 128), generator=g) * 0.7).to(dtype)  # 5-D and 6-D page objects
for kv, codecs in ((canonical, ["rans", "splitzip", "zstd", "raw"]),
                   (pages, [{"id": "rans", "token_axis": 5}, "splitzip", "zstd"])):
    for c in codecs:
        if not get_codec(c).supports(DType.from_torch(dtype)):
            continue
        blob = encode_chunk(kv, get_codec(c))
        out = decode_chunk(blob)
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)), c
        if kv is pages:  # a page object landing whole decodes straight into its pages
            into = memoryview(bytearray(kv.numel() * kv.element_size()))
            cut = len(into) // 3 // 4 * 4
            decode_payload_into(blob, read_header(blob), PageExtents([into[:cut], into[cut:]]))
after = {n: len(f.signatures) for n, f in dispatchers().items()}
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_warm_up_leaves_nothing_to_compile_for_a_load(tmp_path, dtype: str) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "empty-numba-cache"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, dtype], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"], "no numba kernels found: the check would prove nothing"
    if dtype == "bfloat16":  # the numba codecs (rans, splitzip) hold bf16; for fp16 only zstd and raw run
        assert any(seen["before"].values()), "warm_up compiled no kernel"
    grew = {n: (seen["before"][n], k) for n, k in seen["after"].items() if k != seen["before"][n]}
    assert not grew, f"compiled on the load path after warm_up (signatures before, after): {grew}"
