"""Device-check sections for what the KVCodec paper rests on: NVDEC throughput, a CudaFetcher load of video chunks,
and how much each decoder slows a GEMM running beside it.

Called by ``benchmarks/gpu_check.py``'s ``main()`` (each ``sec_X(d)`` fills its
section's dict; a failure is recorded there and the next section runs), before
its ``nvcodec`` section, whose NVENC probe is the last thing the check does: a
crash in the encoder library must not lose these figures.

* ``nvdec_decode``: NVDEC's HEVC 4:4:4 caps (``GetDecoderCaps``: supported,
  engines, min/max size); one reused decoder session decoding the data file's
  HEVC chunk (256 tokens of SmolLM2 KV, 5 pictures of 192 x 1024) ``REPEATS``
  times into a device buffer allocated once, timed between two
  synchronisations (nothing host-side inside: no demuxer, no pageable copy, no
  hash); then 2..7 sessions on as many threads (the GPU's NVDEC engines work
  in parallel); then the full chunk and a 100-token tail (192 x 1000)
  alternately through the product's session pool (one decoder per picture
  size), bit-exact. The session's creation is timed apart.
* ``video_fetcher``: the data file's video payload stored as ``CHUNKS`` objects
  (one per 256-token chunk, all 30 layers) and loaded through ``CudaFetcher``
  into packed paged caches: NVDEC, the Triton join and checksum, the scatter.
  Bit-exact against the CPU layout; GB/s of KV; ``sessions``, the pool size
  the product uses on this device (``min(NVDEC engines, fetch threads)``);
  ``stages``, the seconds of each stage timed on its own over the same objects
  (decode, join, checksum: the chunk's value digest and, for comparison, the
  old one-program exponent hash; scatter), and ``stages_splitzip``, the same
  for the SplitZip device path (decode, value digest, scatter).
* ``sm_interference``: a bf16 GEMM loop on the compute stream, its TFLOP/s
  alone, then while ``CudaFetcher`` loads chunks decoded by NVDEC (video), by
  the Triton SplitZip kernels (splitzip), and on the CPU then copied (rans:
  numba; the image has no PyAV for the CPU video decoder); each load's GB/s
  alone and under the GEMM.

``--dry-run`` (``TRITON_INTERPRET=1``, a CPU): the same code at tiny sizes, the
product's NVDEC sessions over a stand-in of PyNvVideoCodec 2.0.4
(:mod:`vllm_kvcodec.tools.gpu_nvc_stand_in`: libav behind it, or the known
pictures of placeholder streams where PyAV is blocked), kernels in Triton's
interpreter, a CPU GEMM; the figures mean nothing, reaching them is the point.
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


def _video(name: str = "video") -> tuple[memoryview, tuple[int, ...], torch.Tensor]:
    """(payload, shape, the KV it holds): the data file's chunk on a GPU; a small chunk made here with x265 (dry run)."""
    from vllm_kvcodec.format import payload_of, read_header

    data = _data()
    if DRY:
        from vllm_kvcodec.format import encode_chunk

        tokens = (0, 16) if name == "video" else (16, 136)  # 1 picture of 192 x 144; the "tail" 192 x 160
        base = data["kv"] if data else torch.randn(2, 2, 136, 3, 64)
        kv = base[:2, :, tokens[0] : tokens[1]].to(torch.bfloat16).contiguous()
        blob = encode_chunk(kv, "video") if _have_av() else _oracle_blob(kv)
    else:
        if data is None or data.get(name) is None:
            raise RuntimeError(f"no {name} chunk in {DATA} (benchmarks/make_gpu_check_data.py writes it)")
        blob = data[name]["blob"].numpy().tobytes()
        a, b = data[name]["tokens"]
        kv = data["kv"][:, :, a:b].contiguous()
    head = read_header(blob)
    return payload_of(blob, head), tuple(head.shape), kv


def _have_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


#: Dry run without PyAV (the CI test blocks what the device image lacks): packet bytes -> the picture it stands for.
_ORACLE: dict[bytes, Any] = {}


def _oracle_blob(kv: torch.Tensor) -> bytes:
    """A ``video`` chunk of ``kv`` whose packets are placeholders the stand-in decoder knows the pictures of."""
    import numpy as np
    import xxhash

    from vllm_kvcodec.codecs.video import _HEAD, VideoCodec, split
    from vllm_kvcodec.codecs.video_layout import geometry, to_planes
    from vllm_kvcodec.codecs.dtypes import DType
    from vllm_kvcodec.format import ValueDigest, build_chunk, value_digest

    bits = kv.contiguous().view(torch.int16).numpy().view(np.uint16)
    geo = geometry(tuple(kv.shape))
    exps, signman = split(bits.reshape(-1), DType.BFLOAT16)
    planes = to_planes(exps, geo)
    packets = [b"\0\0\0\1" + i.to_bytes(4, "little") + xxhash.xxh3_64_digest(exps) for i in range(geo.frames)]
    _ORACLE.update(zip(packets, planes))
    sizes = np.array([len(p) for p in packets], dtype="<u4").tobytes()
    payload = b"".join([_HEAD.pack(geo.width, geo.height, geo.frames, xxhash.xxh3_64_intdigest(exps)),
                        signman.tobytes(), sizes, *packets])
    segment = VideoCodec.value_digest_segment
    return build_chunk(payload, DType.BFLOAT16, tuple(kv.shape), {"id": "video", "backend": "hevc", "layout": 1},
                       value_digest=ValueDigest(segment, value_digest(bits.tobytes(), segment)))


def _session_factory() -> tuple[Any, str]:
    """The product's NVDEC sessions where NVDEC works here; over the 2.0.4 stand-in on a dry run; else why not."""
    from vllm_kvcodec.gpu import nvcodec
    from vllm_kvcodec.gpu.nvdec_sessions import NvdecSessions

    ok, reason = nvcodec.nvdec_available() if DEVICE.type == "cuda" else (False, "no CUDA device")
    if ok:
        return NvdecSessions(nvcodec.import_nvc()), reason
    if DRY:
        from vllm_kvcodec.tools.gpu_nvc_stand_in import KnownPictures, LibavPictures, StandInNvc

        if _have_av():
            return NvdecSessions(StandInNvc(LibavPictures)), f"PyNvVideoCodec 2.0.4 stand-in, libav behind it ({reason})"
        return (NvdecSessions(StandInNvc(lambda: KnownPictures(_ORACLE))),
                f"PyNvVideoCodec 2.0.4 stand-in, known pictures behind it: no PyAV ({reason})")
    return None, reason


def _timed(fn: Any) -> float:
    """Seconds ``fn``'s device work takes on the current stream (CUDA events; wall time on a CPU)."""
    if DEVICE.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def sec_nvdec_decode(d: dict) -> None:
    """NVDEC's caps; decode throughput of one reused session, then 2..7 sessions on threads; two picture sizes."""
    from vllm_kvcodec.format.device_chunks import parse_video_payload
    from vllm_kvcodec.gpu.nvdec_sessions import decoder_caps

    factory, reason = _session_factory()
    d["decoder"] = reason
    if factory is None:
        d["status"] = f"skipped: {reason}"
        return
    d["caps"] = decoder_caps(DEVICE, factory.nvc)
    _log(f"NVDEC caps (HEVC 4:4:4 8-bit): {d['caps']}")
    payload, shape, kv = _video()
    parsed = parse_video_payload(payload, shape)
    packets = parsed.packets()
    geo = parsed.geometry
    t = time.perf_counter()
    session = factory(DEVICE)
    d["session_create_s"] = round(time.perf_counter() - t, 4)
    out = torch.empty((geo.frames, 3, geo.height, geo.width), dtype=torch.uint8, device=DEVICE)
    session.decode_into(packets, geo.width, geo.height, out)  # warm: the decoder's surfaces, the copy kernels
    _sync()
    d["bit_exact_exponents"] = bool(torch.equal(_exponents(out, geo), _want_exponents(kv)))
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
    d["two_sizes"] = _two_sizes(factory)
    _log(f"NVDEC full chunk and tail through the session pool: {d['two_sizes']}")
    if not d["bit_exact_exponents"] or d["two_sizes"].get("bit_exact") is not True:
        d["status"] = "MISMATCH"


def _exponents(planes: torch.Tensor, geo: Any) -> torch.Tensor:
    from vllm_kvcodec.gpu import nvcodec

    return nvcodec.planes_to_exponents(planes, geo).cpu()


def _want_exponents(kv: torch.Tensor) -> torch.Tensor:
    return ((kv.contiguous().view(torch.int16).view(-1).to(torch.int32) >> 7) & 0xFF).to(torch.uint8)


def _two_sizes(factory: Any) -> dict:
    """The full chunk and the tail, alternately, through the product's pool (one decoder per picture size)."""
    from vllm_kvcodec.format.device_chunks import parse_video_payload
    from vllm_kvcodec.gpu.nvdec_sessions import SessionPool

    pool = SessionPool(lambda: factory(DEVICE), 2)
    chunks = []
    for name in ("video", "video_tail"):
        payload, shape, kv = _video(name)
        chunks.append((parse_video_payload(payload, shape), _want_exponents(kv)))
    exact = True
    for parsed, want in chunks * 3:
        geo = parsed.geometry
        out = torch.empty((geo.frames, 3, geo.height, geo.width), dtype=torch.uint8, device=DEVICE)
        with pool.take((geo.width, geo.height)) as session:
            session.decode_into(parsed.packets(), geo.width, geo.height, out)
        _sync()
        exact &= bool(torch.equal(_exponents(out, geo), want))
    pool.close()
    return {"sizes": [[p.geometry.width, p.geometry.height, p.geometry.frames] for p, _ in chunks],
            "decoders_created": pool.created, "bit_exact": exact}


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
    from vllm_kvcodec.codecs.video import VideoCodec
    from vllm_kvcodec.format import ValueDigest, build_chunk, read_header, value_digest
    from vllm_kvcodec.tools import gpu_load_check as lc

    payload, shape, kv = _video()
    tokens = kv.shape[2]
    tiled = torch.cat([kv] * CHUNKS, dim=2).contiguous()
    block = 8 if DRY else 16
    encode_as = "raw" if codec == "video" and not (DRY and _have_av()) else codec
    sc = lc.build(tiled, chunk_size=tokens, layers_per_object=kv.shape[0], block_size=block, codecs=[encode_as])
    if encode_as != codec:  # every object holds the same KV: the same payload and value digest
        segment = VideoCodec.value_digest_segment
        digest = ValueDigest(segment, value_digest(kv.view(torch.int16).numpy().tobytes(), segment))
        for spec in sc.specs:
            for chunk in spec.chunks:
                key = sc.addresses.key(chunk.chunk_hash, 0)
                head = read_header(sc.store.get(key), key=key)
                sc.store.put(key, build_chunk(payload, head.dtype, head.shape, {"id": "video", "backend": "hevc",
                                                                               "layout": 1}, key=key, value_digest=digest))
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
    """An end-to-end CudaFetcher load of video chunks: NVDEC, join and checksum on the device, scatter; bit-exact.
    Then each stage of the same objects timed on its own, for video and for SplitZip."""
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
        nvdec = loader.fetcher.placement.nvdec
        d["chunks"] = CHUNKS
        d["failed_blocks"] = len(job.failed_blocks)
        d["bit_exact_vs_cpu_layout"] = lc.caches_equal(loader.caches, sc.expected())
        d["seconds"] = round(seconds, 4)
        d["kv_GBps"] = _gbps(loader.raw, seconds)
        d["sessions"] = nvdec.sessions  # min(NVDEC engines, fetch threads): what the product uses here
        d["fetch_threads"] = nvdec.threads
        d["nvdec_fallback"] = nvdec.unavailable
        d["stages"] = _video_stages(sc, factory, loader)
    finally:
        loader.close()
    _log(f"video fetcher: {d}")
    d["stages_splitzip"] = _splitzip_stages()
    _log(f"splitzip stages: {d['stages_splitzip']}")
    if d["failed_blocks"] or not d["bit_exact_vs_cpu_layout"] or d["nvdec_fallback"]:
        d["status"] = "MISMATCH" if d["failed_blocks"] or not d["bit_exact_vs_cpu_layout"] else "NVDEC fell back"
    if not d["stages"]["checks_passed"] or not d["stages_splitzip"]["checks_passed"]:
        d["status"] = "MISMATCH in the stage timings' checks"


def _stage_rows(t: dict, nbytes: int, objects: int) -> dict:
    return {**{k: round(v, 6) for k, v in t.items()}, "objects": objects, "kv_bytes": nbytes,
            **{k.removesuffix("_s") + "_GBps": _gbps(nbytes, v) for k, v in t.items() if v > 0}}


def _video_stages(sc: Any, factory: Any, loader: _Loader) -> dict:
    """Decode, join, checksum (the value digest; the old one-program exponent hash beside it) and scatter of every
    object of the scenario, each stage timed on its own on the current stream (the fetcher's own run overlaps
    them on its threads; this says which one limits)."""
    from vllm_kvcodec.format.device_chunks import ExponentHashCheck, parse_video_payload, value_check
    from vllm_kvcodec.format import payload_of, read_header
    from vllm_kvcodec.gpu.nvdec_join_triton import join_exponents
    from vllm_kvcodec.gpu.nvdec_sessions import SessionPool

    pool = SessionPool(lambda: factory(DEVICE), 1)
    t = dict.fromkeys(("decode_s", "join_s", "checksum_s", "checksum_exponent_hash_s", "scatter_s"), 0.0)
    passed, objects, nbytes = True, 0, 0
    for spec in sc.specs:
        for chunk in spec.chunks:
            key = sc.addresses.key(chunk.chunk_hash, 0)
            blob = sc.store.get(key)
            head = read_header(blob, key=key)
            parsed = parse_video_payload(payload_of(blob, head), head.shape)
            geo = parsed.geometry
            planes = torch.empty((geo.frames, 3, geo.height, geo.width), dtype=torch.uint8, device=DEVICE)
            signman = torch.frombuffer(bytearray(parsed.signman), dtype=torch.uint8).to(DEVICE)
            values = torch.empty(geo.n, dtype=torch.int16, device=DEVICE)
            with pool.take((geo.width, geo.height)) as session:
                t["decode_s"] += _timed(lambda: session.decode_into(parsed.packets(), geo.width, geo.height, planes))
            t["join_s"] += _timed(lambda: join_exponents(planes, signman, geo, values))
            for name, check in (("checksum_s", value_check(head, parsed)),
                                ("checksum_exponent_hash_s", ExponentHashCheck(parsed.exp_hash, geo.n))):
                back = torch.empty(check.readback_bytes, dtype=torch.uint8, device=DEVICE)
                t[name] += _timed(lambda: check.launch(values, back))
                try:
                    check.verify(back.cpu().numpy().tobytes())
                except Exception:  # noqa: BLE001 - recorded: the row must not read as a pass
                    passed = False
            kv = values.view(torch.bfloat16).view(head.shape)
            part = kv[:, :, chunk.first_token : chunk.first_token + len(chunk.slots)]
            slots = torch.tensor(chunk.slots, dtype=torch.int64, device=DEVICE)
            t["scatter_s"] += _timed(lambda: loader.fetcher.pages.scatter(0, part, slots))
            objects += 1
            nbytes += geo.n * 2
    pool.close()
    kind = value_check(head, parsed).kind
    return {**_stage_rows(t, nbytes, objects), "checksum": kind, "checks_passed": passed}


def _splitzip_stages() -> dict:
    """SplitZip's device path, the same way: Triton decode, the value digest of the decoded values, scatter."""
    from vllm_kvcodec.codecs.video import VideoCodec
    from vllm_kvcodec.format.device_chunks import SegmentedDigestCheck
    from vllm_kvcodec.format import ValueDigest, value_digest
    from vllm_kvcodec.gpu import splitzip_triton as sz

    _, _, kv = _video()
    n = kv.numel()
    segment = VideoCodec.value_digest_segment
    check = SegmentedDigestCheck(ValueDigest(segment, value_digest(kv.view(torch.int16).numpy().tobytes(), segment)),
                                 2 * n)
    x = kv.to(DEVICE)
    payload = sz.encode_splitzip_gpu(x)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    back = torch.empty(check.readback_bytes, dtype=torch.uint8, device=DEVICE)
    sc = _scenario("splitzip")
    loader = _Loader(sc, None)
    spec_chunk = sc.specs[0].chunks[0]
    slots = torch.tensor(spec_chunk.slots, dtype=torch.int64, device=DEVICE)
    t = dict.fromkeys(("decode_s", "checksum_s", "scatter_s"), 0.0)
    passed = True
    try:
        for _ in range(CHUNKS):
            t["decode_s"] += _timed(lambda: sz.decode_splitzip_gpu_async(payload, n, out))
            t["checksum_s"] += _timed(lambda: check.launch(out, back))
            try:
                check.verify(back.cpu().numpy().tobytes())
            except Exception:  # noqa: BLE001
                passed = False
            part = out.view(kv.shape)[:, :, spec_chunk.first_token : spec_chunk.first_token + len(spec_chunk.slots)]
            t["scatter_s"] += _timed(lambda: loader.fetcher.pages.scatter(0, part, slots))
    finally:
        loader.close()
    return {**_stage_rows(t, 2 * n * CHUNKS, CHUNKS), "checksum": check.kind, "checks_passed": passed}


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
