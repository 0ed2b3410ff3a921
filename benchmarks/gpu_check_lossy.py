"""Device-check sections for the lossy path (LOSSY: NOT BIT-EXACT vs the KV; its dequantisation is, bit for bit):
the dequantising scatter, a CudaFetcher load of lossy objects, and NVDEC of the int8 integers as HEVC pictures.

Called by ``benchmarks/gpu_check.py``'s ``main()`` (each ``sec_X(d)`` fills its section's dict; a failure is
recorded there and the next section runs). Input: the ``lossy`` entry of ``benchmarks/data/realkv.pt``
(``benchmarks/make_gpu_check_data.py``): int8 and int4 (sink tokens and full layers kept) chunks of real SmolLM2 KV,
and the int8 integers as an x265 lossless HEVC 4:4:4 8-bit stream with the value digest of the integers. The
device encodes nothing; it decodes the rANS planes on the host (numba) as the load path does.

* ``lossy_scatter``: per blob, the host's part (rANS decode and every check, ``unpack_quantized``; the staged bytes
  against the bf16 ones), then ``dequantize_into_pages`` of ``CHUNKS`` copies of the object into packed caches
  shaped like SmolLM2's (NHD and HND; a partial first block, shuffled blocks), timed as a batch of launches,
  against the lossless path's scatter of the same bf16 values (``PackedPages.scatter``) and a device copy;
  bit-exact against the CPU decoder's values scattered by ``PackedKVLayout``, every cache byte.
* ``lossy_fetcher``: ``CHUNKS`` chunks stored as the int8 and int4 objects, loaded through ``CudaFetcher``: every
  object dequantised on the device, bit-exact against the CPU decoder, GB/s of KV, the stats' decode and scatter
  seconds (decode: rANS on the host, staging, one H2D copy).
* ``lossy_nvdec``: the int8 integers' pictures through one reused NVDEC session: bit-exact integers, their digest
  and range checked on the device (``IntegerCheck``), ``REPEATS`` decodes timed, then dequantised into the pages
  bit-exactly; the stream's size against the rANS planes'.

``--dry-run`` (``TRITON_INTERPRET=1``, a CPU): the ``small`` entries (2 layers x 32 tokens), kernels in Triton's
interpreter, NVDEC's sessions over the PyNvVideoCodec 2.0.4 stand-in (libav, or the known pictures of the carried
packets where PyAV is blocked); the figures mean nothing, reaching them is the point.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
DRY = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
SIZE = "small" if DRY else "full"
CHUNKS = 2 if DRY else 16
REPEATS = 2 if DRY else 64
ITERS = 1 if DRY else 10
BLOCK = 8 if DRY else 16
#: Set by gpu_check.py: the video sections' module (its data file, timing, NVDEC session factory and known pictures).
video: Any = None


def _log(msg: str) -> None:
    print(f"   {msg}", flush=True)


def _lossy() -> dict:
    data = video._data()
    if data is None or "lossy" not in data:
        raise RuntimeError(f"no lossy chunks in {video.DATA} (benchmarks/make_gpu_check_data.py writes them)")
    return data["lossy"]


def _blobs() -> dict[str, bytes]:
    return {name: t.numpy().tobytes() for name, t in _lossy()[SIZE].items()}


def _staged(blob: bytes, with_integers: bool = True) -> tuple[Any, Any, float]:
    """(StagedQuantized, header, host seconds of the rANS decode and checks)."""
    from vllm_kvcodec.format import read_header
    from vllm_kvcodec.format.device_quantized import StagedQuantized, unpack_quantized

    head = read_header(blob)
    t = time.perf_counter()
    codec, parts = unpack_quantized(blob, head)
    seconds = time.perf_counter() - t
    return StagedQuantized.of(codec, parts, head, with_integers), head, seconds


def _to_device(staged: Any) -> torch.Tensor:
    host = torch.zeros(staged.nbytes, dtype=torch.uint8, pin_memory=DEVICE.type == "cuda")
    staged.write(host)
    return host.to(DEVICE)


def _caches(layers: int, blocks: int, heads: int, dim: int, order: str) -> list[torch.Tensor]:
    shape = (layers, blocks, BLOCK, heads, 2 * dim) if order == "NHD" else (layers, blocks, heads, BLOCK, 2 * dim)
    whole = torch.randint(-32768, 32767, shape, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    return [whole[i].transpose(1, 2) if order == "NHD" else whole[i] for i in range(layers)]


def _slot_lists(tokens: int, first: int, blocks: int) -> list[torch.Tensor]:
    """CHUNKS slot lists of one object's tokens each (the first from token ``first``), shuffled whole blocks."""
    gen = torch.Generator().manual_seed(0)
    per = tokens // BLOCK
    table = torch.randperm(blocks, generator=gen)[: CHUNKS * per].reshape(CHUNKS, per)
    pos = torch.arange(tokens)
    lists = [table[c][pos // BLOCK] * BLOCK + pos % BLOCK for c in range(CHUNKS)]
    lists[0] = lists[0][first:]
    return lists


def _reference(blob: bytes, caches: list[torch.Tensor], slot_lists: list[torch.Tensor],
               first: int) -> list[torch.Tensor]:
    """The CPU decoder's values through the CPU page layout, from the caches' bytes before the launches."""
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.paged import Geometry, PackedKVLayout

    want = [c.detach().to("cpu", copy=True) for c in caches]
    ref = decode_chunk(blob)
    layout = PackedKVLayout(Geometry(ref.shape[3], ref.shape[4], BLOCK, ref.dtype))
    for c, slots in enumerate(slot_lists):
        at = first if c == 0 else 0
        for i in range(ref.shape[0]):
            layout.scatter(want[i], slots, ref[i, :, at:].contiguous())
    return want


def sec_lossy_scatter(d: dict) -> None:
    """The host's rANS decode, the staged bytes, and the kernel's GB/s against the lossless scatter; bit-exact."""
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.gpu.dequant_triton import dequantize_into_pages
    from vllm_kvcodec.gpu.scatter_triton import PackedPages
    from vllm_kvcodec.tools import gpu_load_check as lc

    exact = True
    for name, blob in _blobs().items():
        staged, head, unpack_s = _staged(blob)
        layers, _, tokens, heads, dim = head.shape
        first = 5
        q = staged.on_device(_to_device(staged))
        ref = decode_chunk(blob).to(DEVICE)
        row: dict[str, Any] = {"shape": list(head.shape), "codec": head.codec_config,
                               "host_unpack_s": round(unpack_s, 5), "staged_bytes": staged.nbytes,
                               "bf16_bytes": ref.numel() * 2, "objects_per_launch_batch": CHUNKS}
        blocks = CHUNKS * tokens // BLOCK + 3
        for order in ("NHD", "HND"):
            caches = _caches(layers, blocks, heads, dim, order)
            pages = PackedPages(caches, dim)
            slot_lists = [s.to(DEVICE) for s in _slot_lists(tokens, first, blocks)]
            want = _reference(blob, caches, [s.cpu() for s in slot_lists], first)

            def dequantize() -> None:
                for c, slots in enumerate(slot_lists):
                    dequantize_into_pages(pages, 0, q, first if c == 0 else 0, slots)

            def lossless() -> None:
                for c, slots in enumerate(slot_lists):
                    pages.scatter(0, ref[:, :, (first if c == 0 else 0) :], slots)

            dequantize()
            video._sync()
            ok = lc.caches_equal(caches, want)
            values = sum(s.numel() for s in slot_lists) * layers * 2 * heads * dim
            t_dq = _median(dequantize)
            t_ll = _median(lossless)
            src = torch.empty(values, dtype=torch.bfloat16, device=DEVICE)
            dst = torch.empty_like(src)
            t_cp = _median(lambda: dst.copy_(src))
            row[order] = {"bit_exact_vs_cpu_decoder": ok,
                          "dequantize_scatter_GBps_bf16_out": video._gbps(2 * values, t_dq),
                          "integers_GBps_in": video._gbps(values, t_dq),
                          "lossless_scatter_GBps": video._gbps(2 * values, t_ll),
                          "device_copy_GBps": video._gbps(2 * values, t_cp)}
            exact &= ok
        d[name] = row
        _log(f"{name}: {row}")
    d["bit_exact"] = exact
    if not exact:
        d["status"] = "MISMATCH (see rows)"


def _median(fn: Any) -> float:
    fn()
    video._sync()
    times = sorted(video._timed(fn) for _ in range(ITERS))
    return times[len(times) // 2]


def sec_lossy_fetcher(d: dict) -> None:
    """CudaFetcher over int8 and int4 objects (CHUNKS chunks, one object per chunk): all dequantised on the device."""
    from vllm_kvcodec.format import build_chunk, read_header
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.paged import PackedKVLayout
    from vllm_kvcodec.stats import ConnectorStats
    from vllm_kvcodec.tools import gpu_load_check as lc

    blobs = _blobs()
    names = list(blobs)
    head = read_header(blobs[names[0]])
    layers, _, tokens, _, _ = head.shape
    kv = video._data()["kv"][:layers, :, :tokens]
    sc = lc.build(torch.cat([kv] * CHUNKS, dim=2).contiguous(), chunk_size=tokens, layers_per_object=layers,
                  block_size=BLOCK, codecs=["raw"], first_token=5)
    for c, h in enumerate(sorted(sc.index, key=sc.index.get)):  # each chunk's object: a lossy blob, under its key
        key = sc.addresses.key(h, 0)
        blob = blobs[names[c % len(names)]]
        head = read_header(blob)
        sc.store.put(key, build_chunk(memoryview(blob)[head.payload_offset : head.payload_offset + head.payload_length],
                                      head.dtype, head.shape, head.codec_config, key=key))
    sc.codecs = [f"int{read_header(blobs[n]).codec_config['bits']}" for n in names]  # lossy: the CPU decoder's values
    for spec in sc.specs:  # read as the lossy levels they are (a lossless read refuses a lossy object)
        for chunk in spec.chunks:
            chunk.precisions = (sc.codecs[sc.index[chunk.chunk_hash] % len(names)],)
    caches = sc.caches(DEVICE)
    stats = ConnectorStats()
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, [PackedKVLayout(sc.geometry)] * len(caches), 4, stats,
                          variants={level: sc.addresses for level in sc.codecs})
    try:
        t = time.perf_counter()
        job = fetcher.submit(sc.specs, 120)
        assert job.done.wait(120), "load not done"
        job.settle()
        video._sync()
        seconds = time.perf_counter() - t
    finally:
        fetcher.shutdown()
    totals = stats.totals()
    d.update({"objects": totals.get("loaded_objects", 0), "device_decoded": totals.get("gpu_decoded_objects", 0),
              "failed_blocks": len(job.failed_blocks),
              "bit_exact_vs_cpu_decoder": lc.caches_equal(caches, sc.expected()),
              "seconds": round(seconds, 4), "kv_GBps": video._gbps(totals.get("loaded_raw_bytes", 0), seconds),
              "stored_bytes": totals.get("loaded_bytes", 0), "raw_bytes": totals.get("loaded_raw_bytes", 0),
              "decode_s": round(totals.get("decode_s", 0), 4), "scatter_s": round(totals.get("scatter_s", 0), 4)})
    _log(f"lossy fetcher: {d}")
    if d["failed_blocks"] or not d["bit_exact_vs_cpu_decoder"] or d["device_decoded"] != d["objects"]:
        d["status"] = "MISMATCH"


def sec_lossy_nvdec(d: dict) -> None:
    """NVDEC of the int8 integers' HEVC 4:4:4 pictures: exact integers, checked on the device, timed, dequantised."""
    from vllm_kvcodec.format import ValueDigest
    from vllm_kvcodec.tools.gpu_integer_video import (
        IntegerCheck, decode_integer_planes, integer_geometry, integer_planes, integer_shape)
    from vllm_kvcodec.gpu import nvcodec
    from vllm_kvcodec.gpu.dequant_triton import dequantize_into_pages
    from vllm_kvcodec.gpu.scatter_triton import PackedPages
    from vllm_kvcodec.tools import gpu_load_check as lc

    lossy = _lossy()
    stream = lossy.get(f"video_{SIZE}")
    if stream is None:
        d["status"] = "skipped: no lossy video stream in the data file (PyAV was missing where it was made)"
        return
    blob = _blobs()[stream["of"]]
    staged, head, _ = _staged(blob, with_integers=False)
    shape = integer_shape(head.shape, staged.codec)
    geo = integer_geometry(head.shape, staged.codec)
    packets = nvcodec.split_packets(stream["stream"].numpy().tobytes(), stream["sizes"])
    video._ORACLE.update(zip((bytes(p) for p in packets), integer_planes(staged.parts, geo)))  # dry run, no PyAV
    factory, reason = video._session_factory()
    d["decoder"] = reason
    if factory is None:
        d["status"] = f"skipped: {reason}"
        return
    want = torch.from_numpy(np.stack([staged.parts.keys, staged.parts.values]))
    session = factory(DEVICE)
    try:
        ints = decode_integer_planes(packets, shape, session, DEVICE)
        video._sync()
        d["bit_exact_integers"] = bool(torch.equal(ints.cpu(), want))
        check = IntegerCheck(ValueDigest(stream["segment"], stream["digest"]), want.numel(), staged.codec.levels)
        back = torch.empty(check.readback_bytes, dtype=torch.uint8, device=DEVICE)
        check.launch(ints, back)
        check.verify(back.cpu().numpy().tobytes())
        d["integer_check_passed"] = check.kind
        t = time.perf_counter()
        for _ in range(REPEATS):
            decode_integer_planes(packets, shape, session, DEVICE)
        video._sync()
        seconds = time.perf_counter() - t
    finally:
        session.close()
    d["pictures"] = [geo.frames, geo.width, geo.height]
    d["one_session"] = {"chunks": REPEATS, "seconds": round(seconds, 4),
                        "pictures_per_s": round(REPEATS * geo.frames / seconds, 1),
                        "integers_GBps": video._gbps(REPEATS * geo.n, seconds),
                        "kv_GBps_bf16": video._gbps(REPEATS * geo.n * 2, seconds)}
    d["stream_bytes"], d["rans_blob_bytes"], d["integers"] = len(stream["stream"]), len(blob), geo.n
    layers, _, tokens, heads, dim = head.shape
    blocks = CHUNKS * tokens // BLOCK + 3
    caches = _caches(layers, blocks, heads, dim, "NHD")
    slots = _slot_lists(tokens, 0, blocks)[0]
    want_pages = _reference(blob, caches, [slots], 0)
    q = staged.on_device(_to_device(staged), ints)
    dequantize_into_pages(PackedPages(caches, dim), 0, q, 0, slots.to(DEVICE))
    video._sync()
    d["bit_exact_pages"] = lc.caches_equal(caches, want_pages)
    _log(f"lossy NVDEC: {d}")
    if not (d["bit_exact_integers"] and d["bit_exact_pages"]):
        d["status"] = "MISMATCH"


__all__ = ["sec_lossy_fetcher", "sec_lossy_nvdec", "sec_lossy_scatter"]
