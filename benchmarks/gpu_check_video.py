"""Device-check sections for what the KVCodec paper rests on: NVDEC throughput, a CudaFetcher load of video chunks,
and how much each decoder slows a GEMM running beside it.

Called by ``benchmarks/gpu_check.py``'s ``main()`` (each ``sec_X(d)`` fills its
section's dict; a failure is recorded there and the next section runs), before
its ``nvcodec`` section, whose NVENC probe is the last thing the check does: a
crash in the encoder library must not lose these figures.

* ``nvdec_decode``: one reused decoder session decoding the data file's HEVC
  chunk (256 tokens of SmolLM2 KV, 5 pictures of 192 x 1024) ``REPEATS`` times
  into a device buffer allocated once, timed between two synchronisations
  (nothing host-side inside: no demuxer, no pageable copy, no hash); then 2..7
  sessions on as many threads (the GPU's NVDEC engines work in parallel). The
  session's creation is timed apart.
* ``video_fetcher``: the data file's video payload stored as ``CHUNKS`` objects
  (one per 256-token chunk, all 30 layers) and loaded through ``CudaFetcher``
  into packed paged caches: NVDEC, the Triton join and checksum, the scatter.
  Bit-exact against the CPU layout; GB/s of KV.
* ``sm_interference``: a bf16 GEMM loop on the compute stream, its TFLOP/s
  alone, then while ``CudaFetcher`` loads chunks decoded by NVDEC (video), by
  the Triton SplitZip kernels (splitzip), and on the CPU then copied (rans:
  numba; the image has no PyAV for the CPU video decoder); each load's GB/s
  alone and under the GEMM.

``--dry-run`` (``TRITON_INTERPRET=1``, a CPU): the same code at tiny sizes,
libav standing in for NVDEC, kernels in Triton's interpreter, a CPU GEMM; the
figures mean nothing, reaching them is the point.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
DATA = ROOT / "benchmarks" / "data" / "realkv.pt"
DRY = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
REPEATS = 4 if DRY else 64
SESSIONS = (2,) if DRY else (2, 3, 4, 5, 6, 7)
CHUNKS = 2 if DRY else 16
GEMM = 64 if DRY else 8192  # square bf16 GEMM side
GEMM_SECONDS = 0.2 if DRY else 2.0
_DATA: dict | None = None


def _log(msg: str) -> None:
    print(f"   {msg}", flush=True)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _data() -> dict | None:
    global _DATA
    if _DATA is None and DATA.exists():
        _DATA = torch.load(DATA, weights_only=True)
    return _DATA


def _gbps(nbytes: float, seconds: float) -> float:
    return float(f"{nbytes / max(seconds, 1e-9) / 1e9:.4g}")


# ---- the video chunk and decoder sessions ----------------------------------------------------------------


def _video() -> tuple[memoryview, tuple[int, ...], torch.Tensor]:
    """(payload, shape, the KV it holds): the data file's chunk on a GPU; a small chunk made here with x265 (dry run)."""
    from vllm_kvcodec.format import payload_of, read_header

    data = _data()
    if DRY:
        from vllm_kvcodec.format import encode_chunk

        kv = (data["kv"][:2, :, :16] if data else torch.randn(2, 2, 16, 3, 64)).to(torch.bfloat16).contiguous()
        blob = encode_chunk(kv, "video") if _have_av() else _oracle_blob(kv)
    else:
        if data is None or data.get("video") is None:
            raise RuntimeError(f"no video chunk in {DATA} (benchmarks/make_gpu_check_data.py writes it)")
        blob = data["video"]["blob"].numpy().tobytes()
        a, b = data["video"]["tokens"]
        kv = data["kv"][:, :, a:b].contiguous()
    head = read_header(blob)
    return payload_of(blob, head), tuple(head.shape), kv


def _have_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


#: Dry run without PyAV (the CI test blocks what the device image lacks): stream bytes -> the pictures they stand for.
_ORACLE: dict[bytes, torch.Tensor] = {}


def _oracle_blob(kv: torch.Tensor) -> bytes:
    """A ``video`` chunk of ``kv`` whose stream is a placeholder the oracle session knows the pictures of."""
    import numpy as np
    import xxhash

    from vllm_kvcodec.codecs.video import _HEAD, split
    from vllm_kvcodec.codecs.video_layout import geometry, to_planes
    from vllm_kvcodec.dtypes import DType
    from vllm_kvcodec.format import build_chunk

    bits = kv.contiguous().view(torch.int16).numpy().view(np.uint16)
    geo = geometry(tuple(kv.shape))
    exps, signman = split(bits.reshape(-1), DType.BFLOAT16)
    packets = [b"\0\0\0\1" + i.to_bytes(4, "little") + xxhash.xxh3_64_digest(exps) for i in range(geo.frames)]
    _ORACLE[b"".join(packets)] = torch.from_numpy(to_planes(exps, geo))
    sizes = np.array([len(p) for p in packets], dtype="<u4").tobytes()
    payload = b"".join([_HEAD.pack(geo.width, geo.height, geo.frames, xxhash.xxh3_64_intdigest(exps)),
                        signman.tobytes(), sizes, *packets])
    return build_chunk(payload, DType.BFLOAT16, tuple(kv.shape), {"id": "video", "backend": "hevc", "layout": 1})


class _OracleSession:
    """Dry run without PyAV: the pictures a placeholder stream stands for (the pipeline after the decoder runs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def decode_into(self, packets: list, width: int, height: int, out: torch.Tensor) -> None:
        out.copy_(_ORACLE[b"".join(bytes(p) for p in packets)])

    def close(self) -> None:
        pass


def _session_factory() -> tuple[Any, str]:
    """NVDEC sessions where NVDEC works here; libav standing in on a dry run; else why not."""
    from vllm_kvcodec.gpu import nvcodec
    from vllm_kvcodec.gpu.nvdec_sessions import LibavSession, NvdecSession

    ok, reason = nvcodec.nvdec_available() if DEVICE.type == "cuda" else (False, "no CUDA device")
    if ok:
        return NvdecSession, reason
    if DRY and _have_av():
        return LibavSession, f"libav standing in for NVDEC ({reason})"
    if DRY:
        return _OracleSession, f"no PyAV: the known pictures stand in for NVDEC ({reason})"
    return None, reason


def sec_nvdec_decode(d: dict) -> None:
    """NVDEC decode throughput: one reused session, then 2..7 sessions on threads."""
    from vllm_kvcodec.gpu import nvcodec

    factory, reason = _session_factory()
    d["decoder"] = reason
    if factory is None:
        d["status"] = f"skipped: {reason}"
        return
    payload, shape, kv = _video()
    parsed = nvcodec.parse_video_payload(payload, shape)
    packets = nvcodec.split_packets(parsed.stream, parsed.packet_sizes)
    geo = parsed.geometry
    t = time.perf_counter()
    session = factory(DEVICE)
    d["session_create_s"] = round(time.perf_counter() - t, 4)
    out = torch.empty((geo.frames, 3, geo.height, geo.width), dtype=torch.uint8, device=DEVICE)
    session.decode_into(packets, geo.width, geo.height, out)  # warm: the decoder's surfaces, the copy kernels
    _sync()
    exps = nvcodec.planes_to_exponents(out, geo).cpu()
    want = ((kv.contiguous().view(torch.int16).view(-1).to(torch.int32) >> 7) & 0xFF).to(torch.uint8)
    d["bit_exact_exponents"] = bool(torch.equal(exps, want))
    t = time.perf_counter()
    for _ in range(REPEATS):
        session.decode_into(packets, geo.width, geo.height, out)
    _sync()
    seconds = time.perf_counter() - t
    d["one_session"] = _decode_row(REPEATS, geo, seconds, len(parsed.stream))
    _log(f"NVDEC one session: {d['one_session']}")
    session.close()
    d["threads"] = {}
    for count in SESSIONS:
        d["threads"][str(count)] = row = _threaded(factory, count, packets, geo, len(parsed.stream))
        _log(f"NVDEC {count} sessions: {row}")


def _decode_row(chunks: int, geo: Any, seconds: float, stream_bytes: int) -> dict:
    return {"chunks": chunks, "seconds": round(seconds, 4), "pictures_per_s": round(chunks * geo.frames / seconds, 1),
            "chunks_per_s": round(chunks / seconds, 1), "stream_MBps": round(chunks * stream_bytes / seconds / 1e6, 1),
            "kv_GBps": _gbps(chunks * geo.n * 2, seconds)}  # bf16 KV whose exponents these pictures hold


def _threaded(factory: Any, count: int, packets: list, geo: Any, stream_bytes: int) -> dict:
    """``count`` sessions, one per thread, each on its own stream, each decoding REPEATS // 2 chunks."""
    sessions = [factory(DEVICE) for _ in range(count)]
    outs = [torch.empty((geo.frames, 3, geo.height, geo.width), dtype=torch.uint8, device=DEVICE) for _ in range(count)]
    each = max(1, REPEATS // 2)
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            stream = torch.cuda.Stream(DEVICE) if DEVICE.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else _null():
                for _ in range(each):
                    sessions[i].decode_into(packets, geo.width, geo.height, outs[i])
                if stream is not None:
                    stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported in the row
            errors.append(f"{type(exc).__name__}: {exc}")

    for i in range(count):  # warm each session once
        sessions[i].decode_into(packets, geo.width, geo.height, outs[i])
    _sync()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _sync()
    row = _decode_row(each * count, geo, time.perf_counter() - t, stream_bytes)
    for s in sessions:
        s.close()
    if errors:
        row["errors"] = errors[:3]
    return row


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


# ---- loads through CudaFetcher ---------------------------------------------------------------------------


def _scenario(codec: str) -> Any:
    """CHUNKS chunks of the video chunk's KV (one object per chunk, all layers), stored with ``codec``.

    ``video`` objects on a GPU carry the data file's payload (the image has no
    PyAV to encode): the same payload under each object's key.
    """
    from vllm_kvcodec.format import build_chunk, read_header
    from vllm_kvcodec.tools import gpu_load_check as lc

    payload, shape, kv = _video()
    tokens = kv.shape[2]
    tiled = torch.cat([kv] * CHUNKS, dim=2).contiguous()
    block = 8 if DRY else 16
    encode_as = "raw" if codec == "video" and not (DRY and _have_av()) else codec
    sc = lc.build(tiled, chunk_size=tokens, layers_per_object=kv.shape[0], block_size=block, codecs=[encode_as])
    if encode_as != codec:
        for spec in sc.specs:
            for chunk in spec.chunks:
                key = sc.addresses.key(chunk.chunk_hash, 0)
                head = read_header(sc.store.get(key), key=key)
                sc.store.put(key, build_chunk(payload, head.dtype, head.shape, {"id": "video", "backend": "hevc",
                                                                               "layout": 1}, key=key))
    return sc


class _Loader:
    """One CudaFetcher over fresh packed caches, loading the scenario again and again (timed: submit to the side
    stream's end; the compute stream is not synchronised, a GEMM may run there)."""

    def __init__(self, sc: Any, factory: Any, threads: int = 4) -> None:
        from vllm_kvcodec.load.cuda_placement import CudaFetcher
        from vllm_kvcodec.paged import PackedKVLayout
        from vllm_kvcodec.stats import ConnectorStats

        self.sc = sc
        self.caches = sc.caches(DEVICE)
        layouts = [PackedKVLayout(sc.geometry)] * len(self.caches)
        self.fetcher = CudaFetcher(sc.store, sc.addresses, self.caches, layouts, threads, ConnectorStats(),
                                   video_sessions=factory)
        self.raw = sc.kv.numel() * sc.kv.element_size()  # every token loads (first_token 0)

    def once(self) -> tuple[float, Any]:
        t = time.perf_counter()
        job = self.fetcher.submit(self.sc.specs, 300)
        assert job.done.wait(300), "load did not finish"
        if self.fetcher.side.stream is not None:
            self.fetcher.side.stream.synchronize()  # every scatter has landed
        return time.perf_counter() - t, job

    def close(self) -> None:
        self.fetcher.shutdown()


def sec_video_fetcher(d: dict) -> None:
    """An end-to-end CudaFetcher load of video chunks: NVDEC, join and checksum on the device, scatter; bit-exact."""
    from vllm_kvcodec.tools import gpu_load_check as lc

    factory, reason = _session_factory()
    d["decoder"] = reason
    if factory is None:
        d["status"] = f"skipped: {reason}"
        return
    sc = _scenario("video")
    loader = _Loader(sc, factory)
    try:
        loader.once()  # warm: sessions, staging, kernels
        seconds, job = loader.once()
        d["chunks"] = CHUNKS
        d["failed_blocks"] = len(job.failed_blocks)
        d["bit_exact_vs_cpu_layout"] = lc.caches_equal(loader.caches, sc.expected())
        d["seconds"] = round(seconds, 4)
        d["kv_GBps"] = _gbps(loader.raw, seconds)
    finally:
        loader.close()
    _log(f"video fetcher: {d}")
    if d["failed_blocks"] or not d["bit_exact_vs_cpu_layout"]:
        d["status"] = "MISMATCH"


# ---- SM interference -------------------------------------------------------------------------------------


def _sync_compute() -> None:
    """Wait for this thread's (compute) stream only: the load's side stream keeps running."""
    if DEVICE.type == "cuda":
        torch.cuda.current_stream(DEVICE).synchronize()


def _gemm_loop(seconds: float) -> dict:
    """bf16 GEMMs on the current (compute) stream for ``seconds``: TFLOP/s."""
    a = torch.randn(GEMM, GEMM, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device=DEVICE).to(torch.bfloat16)
    c = a @ b
    _sync_compute()
    done, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(4):
            torch.matmul(a, b, out=c)
        done += 4
        _sync_compute()
    elapsed = time.perf_counter() - t
    return {"gemms": done, "seconds": round(elapsed, 3), "TFLOPs": float(f"{2 * GEMM**3 * done / elapsed / 1e12:.4g}")}


def sec_sm_interference(d: dict) -> None:
    """GEMM TFLOP/s alone and while chunks load, per decoder; each decoder's GB/s alone and under the GEMM."""
    d["gemm"] = f"{GEMM}^3 bf16"
    d["gemm_alone"] = _gemm_loop(GEMM_SECONDS)
    _log(f"GEMM alone: {d['gemm_alone']}")
    factory, reason = _session_factory()
    cases = {"nvdec_video": ("video", factory), "triton_splitzip": ("splitzip", None), "cpu_rans_then_h2d": ("rans", None)}
    for name, (codec, sessions) in cases.items():
        if codec == "video" and sessions is None:
            d[name] = f"skipped: {reason}"
            continue
        try:
            d[name] = _under_gemm(codec, sessions)
        except Exception as exc:  # noqa: BLE001 - one decoder failing must not lose the others
            d[name] = f"error: {type(exc).__name__}: {exc}"
        _log(f"{name}: {d[name]}")
    failed = {name: d[name] for name in cases if str(d[name]).startswith("error")}
    if failed:  # each row is kept above; the section must not read "ok" with a decoder missing
        raise RuntimeError(f"decoders failed under the GEMM: {failed}")


def _under_gemm(codec: str, sessions: Any) -> dict:
    """Loads back to back on a thread while this thread runs the GEMM loop: both rates over the same window."""
    loader = _Loader(_scenario(codec), sessions)
    try:
        loader.once()  # warm
        alone, job = loader.once()
        row: dict[str, Any] = {"load_alone_GBps": _gbps(loader.raw, alone), "failed_blocks": len(job.failed_blocks)}
        stop, started = threading.Event(), threading.Event()
        runs: list[float] = []

        def loads() -> None:
            while not stop.is_set():
                started.set()
                seconds, done = loader.once()
                runs.append(seconds)
                row["failed_blocks"] += len(done.failed_blocks)

        worker = threading.Thread(target=loads)
        worker.start()
        started.wait(60)
        row["gemm_under_load"] = _gemm_loop(GEMM_SECONDS)
        stop.set()
        worker.join()
    finally:
        loader.close()
    row["loads_under_gemm"] = len(runs)
    row["load_under_gemm_GBps"] = _gbps(loader.raw * len(runs), sum(runs)) if runs else None
    return row


__all__ = ["sec_nvdec_decode", "sec_sm_interference", "sec_video_fetcher"]
