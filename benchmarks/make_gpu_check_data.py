#!/usr/bin/env python
"""Write the real-KV input of the GPU device check: ``benchmarks/data/realkv.pt``.

Run on the development machine (it needs the project's model fixture, numba
and, for the video part, PyAV):

    .venv/bin/python benchmarks/make_gpu_check_data.py

The file is generated: keep it out of git. It holds (``torch.load(...,
weights_only=True)``):

* ``kv``: SmolLM2-135M K/V on 1024 tokens, ``real_kv(1024)``: bf16 ``[30, 2, 1024, 3, 64]`` (23.6 MB);
* ``splitzip``: for the whole tensor, its four 256-token chunks and ``small``
  (layers 0-1, tokens 0-31: the dry run's input), the SHA-256
  and length of the CPU codec's payload and of ``encode_chunk(chunk, "splitzip")``
  (the device compares its own bytes against these; no numba needed there);
* ``video``: ``encode_chunk(kv[:, :, :256], "video")`` (HEVC, x265 lossless) as a
  uint8 tensor, with its payload offset/length and shape (so the device needs
  no chunk-format imports), for the NVDEC check (absent if PyAV is missing here);
* ``video_tail``: the same for a 100-token tail (``kv[:, :, 256:356]``: 2
  pictures of 192 x 1000, where the full chunk has 5 of 192 x 1024), so the
  device decodes two picture sizes as the product's sessions must;
* ``lossy`` (LOSSY: NOT BIT-EXACT): lossy chunks for the dequantising scatter,
  ``full`` (the first 256-token chunk, all 30 layers) and ``small`` (layers 0-1,
  tokens 0-31: the dry run's), each as ``int8`` and ``int4_kept`` (int4 keeping
  sink tokens and full layers at full precision) blobs (the device has numba
  for the rANS decode, and needs no encode); and ``video_full`` /
  ``video_small``: the ``int8`` integers as x265 lossless HEVC 4:4:4 8-bit
  pictures (:mod:`vllm_kvcodec.format.device_quantized`'s layout), one packet
  per picture, with the value digest of the integers, for NVDEC.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "data" / "realkv.pt"


def _digest(data: bytes) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from vllm_kvcodec.codecs.splitzip import SplitZipCodec
    from vllm_kvcodec.codecs.dtypes import DType
    from vllm_kvcodec.format import encode_chunk
    from vllm_kvcodec.tools.smollm2 import real_kv

    t0 = time.perf_counter()
    kv = real_kv(args.tokens).contiguous()
    codec = SplitZipCodec()

    def bits(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)

    splitzip = {"full": {"payload": _digest(codec.encode(bits(kv), DType.BFLOAT16)),
                         "chunk": _digest(encode_chunk(kv, "splitzip"))}}
    for i, chunk in enumerate(kv.split(256, dim=2)):
        chunk = chunk.contiguous()
        splitzip[f"chunk{i}"] = {"payload": _digest(codec.encode(bits(chunk), DType.BFLOAT16)),
                                 "chunk": _digest(encode_chunk(chunk, "splitzip")),
                                 "tokens": [256 * i, 256 * (i + 1)]}
    small = kv[:2, :, :32].contiguous()  # the dry run's slice: the Triton interpreter takes minutes per full chunk
    splitzip["small"] = {"payload": _digest(codec.encode(bits(small), DType.BFLOAT16)),
                         "chunk": _digest(encode_chunk(small, "splitzip")), "tokens": [0, 32], "layers": [0, 2]}
    data = {"kv": kv, "splitzip": splitzip, "meta": {"source": "vllm_kvcodec.tools.smollm2.real_kv", "tokens": args.tokens}}
    try:
        from vllm_kvcodec.format import read_header

        for name, (a, b) in (("video", (0, 256)), ("video_tail", (256, 356))):
            blob = encode_chunk(kv[:, :, a:b].contiguous(), "video")  # backend hevc, verified on encode
            head = read_header(blob)
            data[name] = {"blob": torch.frombuffer(bytearray(blob), dtype=torch.uint8), "tokens": [a, b],
                          "backend": "hevc", "payload_offset": head.payload_offset,
                          "payload_length": head.payload_length, "shape": list(head.shape)}
    except Exception as exc:  # noqa: BLE001 - PyAV missing: the device check reports the NVDEC part as skipped
        print(f"no video chunk ({type(exc).__name__}: {exc})")
    data["lossy"] = _lossy(kv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0


def _lossy(kv) -> dict:
    """Lossy chunks of the real KV, and the int8 ones' integers as HEVC pictures (absent if PyAV is missing here)."""
    import numpy as np
    import torch

    from vllm_kvcodec.codecs.precision import Precision
    from vllm_kvcodec.format import encode_chunk, read_header, value_digest
    from vllm_kvcodec.format.device_quantized import unpack_quantized
    from vllm_kvcodec.tools.gpu_integer_video import integer_geometry, integer_planes

    def blob_tensor(blob: bytes):
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    out: dict = {}
    for size, part, keep in (("full", kv[:, :, :256], (4, 2)), ("small", kv[:2, :, :32], (4, 1))):
        blobs = {"int8": encode_chunk(part.contiguous(), precision="int8"),
                 "int4_kept": encode_chunk(part.contiguous(), precision=Precision("int4", *keep))}
        out[size] = {name: blob_tensor(blob) for name, blob in blobs.items()}
        try:
            from vllm_kvcodec.codecs import video_av

            head = read_header(blobs["int8"])
            codec, parts = unpack_quantized(blobs["int8"], head)
            planes = integer_planes(parts, integer_geometry(head.shape, codec))
            packets = video_av.encode_pictures(planes, "hevc", None, 2)
        except Exception as exc:  # noqa: BLE001 - PyAV missing: the device check reports the NVDEC part as skipped
            print(f"no lossy video stream ({type(exc).__name__}: {exc})")
            continue
        integers = np.concatenate([parts.keys.reshape(-1), parts.values.reshape(-1)]).tobytes()
        segment = 16384 if size == "full" else 1024
        out[f"video_{size}"] = {"of": "int8", "stream": blob_tensor(b"".join(packets)),
                                "sizes": [len(p) for p in packets], "segment": segment,
                                "digest": value_digest(integers, segment)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
