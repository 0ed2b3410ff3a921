#!/usr/bin/env python
"""The GPU device check: Triton SplitZip bit-exactness and GB/s, paged scatter GB/s, NVDEC/NVENC.

One prepared run for one GPU (inside 6 minutes on an H200, its budget enforced):

    python benchmarks/gpu_check.py                 # on the GPU machine, from the repo root
    python benchmarks/gpu_check.py --dry-run       # here: Triton interpreter on the CPU, tiny sizes

Needs torch, triton, numpy, numba and xxhash (all on the device image), and
nothing the image lacks: no vLLM, pydantic, zstandard, PyAV or redis-py
(tests/gpu/test_gpu_check_dry_run.py runs the dry run with those imports
blocked). PyNvVideoCodec (NVDEC/NVENC) is used where importable and reported
"absent" otherwise; ``make gpu-bundle`` prepares a carry folder with it. Input:
``benchmarks/data/realkv.pt`` from ``benchmarks/make_gpu_check_data.py``
(real SmolLM2 KV plus the CPU codec's SHA-256 of its payloads and an HEVC
``video`` chunk). Prints a summary and writes JSON to ``$OUT/gpu_check.json``
when ``OUT`` is set, else ``./gpu_check.json``.

The whole run keeps to ``--budget-s`` (default 330 s, so the check ends
inside 6 minutes on an H200): a section that would start past it is skipped,
and a watchdog ends a section still running at it, records it as over budget
and writes the JSON before the process exits (so does SIGTERM). The JSON is
rewritten after every section, atomically.

Sections (each isolated: a failure is recorded and the next one runs; the
NVENC probe, which loads the encoder library, runs last): env (with the
driver's video libraries in one line), then the KVCodec sections of
benchmarks/gpu_check_video.py first (nvdec_decode, video_fetcher with the pool
size and per-stage seconds, sm_interference: before the sweeps and the first
compiles of the rest, so a slow cold cache skips those instead), the lossy
path's of benchmarks/gpu_check_lossy.py (lossy_scatter: the dequantising
scatter's GB/s and bit-exactness on real KV integers; lossy_fetcher; lossy_nvdec:
NVDEC of the int8 integers as an 8-bit 4:4:4 stream), selftest
(every bit-exactness case of vllm_kvcodec.tools.gpu_selftest), realkv
(GPU payloads of real KV vs the CPU codec's digests and the numpy reference,
two layers by 32 tokens in the dry run,
decode of the reference payload), throughput (device copy vs SplitZip encode
and decode on ~1.5 GB of tiled real KV, a small sweep of kernel settings,
histogram phase alone, worst case on random bits), scatter (the Triton
scatter/gather of ``vllm_kvcodec.gpu.scatter_triton`` into vLLM 0.33 packed
K‖V caches sized like SmolLM2-135M and an 8B GQA model, vs the layout's torch
indexing and a plain device copy; bit-exact against the layout), gpu_fetcher
(real KV chunks in a memory store, splitzip decoded on the device and other
codecs on the CPU, through ``CudaFetcher`` into packed caches: bit-exact vs the
CPU layout, one event per layer group, the compute stream reads each layer
right after its event wait, the save path's gather back through the real
``Saver`` into a second memory store, and a payload with a
valid checksum but invalid escapes rejected by the device flags), nvcodec
(NVDEC decode of the HEVC chunk, bit-exact against the KV; NVENC probe).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import importlib.util
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "realkv.pt"
TARGET_ENCODE_GBPS = 1000.0
TARGET_DECODE_GBPS = 2400.0

ENCODE_CONFIGS = [  # the first is the default; every setting must give the same bytes
    {"hist": "window"},
    {"hist": "full"},
    {"hist": "window", "sub": 128, "num_warps": 1},
    {"hist": "window", "sub": 256, "num_warps": 2},
    {"hist": "window", "sub": 512, "num_warps": 4},
    {"hist": "window", "sub": 1024, "num_warps": 4},
    {"hist": "window", "tile": 1024, "sub": 256, "num_warps": 1},
]
DECODE_CONFIGS = [
    {},
    {"block_pairs": 1024, "num_warps": 4},
    {"block_pairs": 2048, "num_warps": 4},
    {"block_pairs": 4096, "num_warps": 8},
    {"block_pairs": 4096, "num_warps": 16},
]
DRY_CASES = [
    "roundtrip[normal_bf16]", "roundtrip[specials]", "roundtrip[n3]", "roundtrip_small_tiles[escape_heavy]",
    "roundtrip_hist_window[normal_bf16]", "decode_device_payload", "invalid_positions_unsorted", "async_flags",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU device check for vllm-kvcodec")
    p.add_argument("--dry-run", action="store_true", help="Triton interpreter on the CPU, tiny sizes")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--gb", type=float, default=1.5, help="throughput input size in GB (bf16 bytes)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="the whole check's time budget: later sections are skipped, a running one is ended, the JSON is written")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


ARGS = parse_args(None if __name__ == "__main__" else [])
if __name__ == "__main__" and ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before torch/triton are imported
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

T0 = time.perf_counter()
faulthandler.enable()  # a crash inside a driver library leaves its stack in the log; the JSON so far is on disk
REPORT: dict = {"dry_run": ARGS.dry_run, "sections": {}, "targets": {}}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class Section:
    """Record one section's result (or its exception) in REPORT; skip it once the budget is spent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: dict = {}

    def __enter__(self) -> dict:
        REPORT["sections"][self.name] = self.data
        if time.perf_counter() - T0 > ARGS.budget_s:
            self.data["status"] = "skipped: time budget spent"
            raise _Skip()
        log(f"== {self.name}")
        self.t = time.perf_counter()
        RUNNING["section"] = self.name
        return self.data

    def __exit__(self, kind, exc, tb) -> bool:
        RUNNING["section"] = None
        if kind is _Skip:
            log(f"== {self.name}: skipped (time budget)")
            return True
        self.data["seconds"] = round(time.perf_counter() - self.t, 2)
        if exc is not None:
            self.data["status"] = f"error: {type(exc).__name__}: {exc}"
            self.data["traceback"] = traceback.format_exc()
            log(f"   ERROR {type(exc).__name__}: {exc}")
        else:
            self.data.setdefault("status", "ok")
        write_report()
        return True


class _Skip(Exception):
    pass


def run_section(name: str, fn) -> None:
    try:
        with Section(name) as data:
            fn(data)
    except _Skip:
        pass


RUNNING: dict = {"section": None}  # the section in progress, for the watchdog
_WRITE_LOCK = threading.RLock()


def remaining_s(cap: float) -> float:
    """Seconds a wait inside a section may take: ``cap``, or less where the budget ends sooner (at least 1)."""
    return max(1.0, min(cap, ARGS.budget_s - (time.perf_counter() - T0)))


def end_over_budget(why: str, code: int) -> None:
    """Record the running section as ended by ``why``, write the JSON, and leave at once (a hung kernel never returns)."""
    name = RUNNING["section"]
    if name is not None:
        REPORT["sections"].setdefault(name, {})["status"] = f"error: {why} while it ran"
    for later, _ in SECTIONS:
        REPORT["sections"].setdefault(later, {"status": f"skipped: {why} before it started"})
    REPORT["ended_by"] = why
    REPORT["summary"] = {k: v.get("status", "?") for k, v in list(REPORT["sections"].items())}
    for _ in range(3):  # the main thread may be adding to the report right now
        try:
            write_report()
            break
        except RuntimeError:
            time.sleep(0.05)
    log(f"{why}: {name or 'between sections'}; wrote {out_path()}")
    os._exit(code)


def start_watchdog() -> None:
    """End the run at ``--budget-s`` whatever it is doing; SIGTERM (a runner's timeout) does the same earlier."""
    timer = threading.Timer(ARGS.budget_s - (time.perf_counter() - T0),
                            end_over_budget, (f"time budget of {ARGS.budget_s:.0f} s spent", 3))
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGTERM, lambda signum, frame: end_over_budget("SIGTERM", 128 + signum))


def out_path() -> Path:
    if ARGS.out is not None:
        return ARGS.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return Path("gpu_check.json")


def write_report() -> None:
    """Replace the JSON atomically: a run ended mid-write still leaves the previous whole report."""
    with _WRITE_LOCK:
        REPORT["elapsed_s"] = round(time.perf_counter() - T0, 1)
        path = out_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(REPORT, indent=1, default=str))
        os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
DEVICE = torch.device("cpu" if ARGS.dry_run else "cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int = 1) -> dict:
    """Median/min seconds of ``fn`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = [video_sections._timed(fn) for _ in range(iters)]
    return {"median_s": statistics.median(times), "min_s": min(times)}


def gbps(nbytes: int, seconds: float) -> float:
    return float(f"{nbytes / seconds / 1e9:.4g}")


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1)


def load_data() -> dict | None:
    if not ARGS.data.exists():
        return None
    return torch.load(ARGS.data, weights_only=True)


DATASET = None


# ----------------------------------------------------------------------------------------------
def sec_env(d: dict) -> None:
    d["python"] = sys.version.split()[0]
    d["platform"] = platform.platform()
    d["torch"] = torch.__version__
    try:
        import triton

        d["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        d["triton"] = f"absent ({exc})"
    d["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        d["gpu"] = p.name
        d["sms"] = p.multi_processor_count
        d["memory_gb"] = round(p.total_memory / 1e9, 1)
        d["cuda"] = torch.version.cuda
    for mod in ("numba", "xxhash", "cupy", "zstandard"):
        try:
            m = __import__(mod)
            d[mod] = getattr(m, "__version__", "present")
        except Exception as exc:  # noqa: BLE001
            d[mod] = f"absent ({type(exc).__name__}: {exc})"
    for mod in ("PyNvVideoCodec", "av"):  # located, not imported: PyNvVideoCodec's import loads the NVENC library
        try:
            d[mod] = "installed" if importlib.util.find_spec(mod) is not None else "absent"
        except Exception as exc:  # noqa: BLE001
            d[mod] = f"absent ({type(exc).__name__}: {exc})"
    d["video_driver"] = video_driver_line()
    from vllm_kvcodec.gpu import splitzip_triton as g

    d["interpreter"] = g.interpreted()
    global DATASET
    DATASET = load_data()
    d["data"] = str(ARGS.data) if DATASET is not None else f"missing: {ARGS.data} (run benchmarks/make_gpu_check_data.py)"
    log(f"   torch {d['torch']} triton {d['triton']} gpu {d.get('gpu', '-')} data {'ok' if DATASET else 'MISSING'}")


def video_driver_line() -> str:
    """One line: which of the driver's video libraries load here, and what the container was given."""
    from vllm_kvcodec.gpu import nvcodec

    libs = nvcodec.driver_video_libraries()
    caps = os.environ.get("NVIDIA_DRIVER_CAPABILITIES", "unset")
    found = ", ".join(f"{name} {'present' if ok else 'absent'}" for name, ok in libs.items())
    if not any(libs.values()):
        return (f"{found}: this container lacks the 'video' driver capability (NVIDIA_DRIVER_CAPABILITIES={caps}); "
                "NVDEC/NVENC figures cannot be taken here")
    if not libs[nvcodec.NVENCODE]:
        return f"{found} (NVIDIA_DRIVER_CAPABILITIES={caps}): NVDEC through PyNvVideoCodec's decoder module, no NVENC"
    return f"{found} (NVIDIA_DRIVER_CAPABILITIES={caps})"


def sec_selftest(d: dict) -> None:
    from vllm_kvcodec.tools import gpu_selftest as selftest

    datasets = None
    if DATASET is not None:
        kv = DATASET["kv"]
        datasets = {"kv_2layers_8tokens": bits16(kv[:2, :, :8]), "kv_odd_1343": bits16(kv[17, 1, 300:308])[:1343]}
    results = selftest.run_cases(str(DEVICE), datasets, DRY_CASES if ARGS.dry_run else None)
    missing_dep = [r for r in results if not r["ok"] and r["detail"].startswith(("ModuleNotFoundError", "ImportError"))]
    failed = [r for r in results if not r["ok"] and r not in missing_dep]
    d["cases"] = len(results)
    d["passed"] = sum(r["ok"] for r in results)
    d["skipped_missing_dependency"] = {r["name"]: r["detail"].split("\n")[0] for r in missing_dep}
    d["failed"] = {r["name"]: r["detail"] for r in failed}
    d["reference"] = next((r["detail"] for r in results if r["ok"] and "identical (" in r["detail"]), "")
    d["results"] = [{k: r[k] for k in ("name", "ok", "seconds")} | {"detail": r["detail"][:300]} for r in results]
    if failed:
        d["status"] = f"FAILED {len(failed)} of {len(results)}"
    log(f"   {d['passed']}/{len(results)} cases passed, {len(missing_dep)} need a missing package, {len(failed)} failed")


def sec_realkv(d: dict) -> None:
    from vllm_kvcodec.tools import splitzip_ref
    from vllm_kvcodec.gpu import splitzip_triton as g

    if DATASET is None:
        d["status"] = "skipped: no data file"
        return
    kv = DATASET["kv"]
    dry = "small" if "small" in DATASET["splitzip"] else "chunk0"  # the interpreter takes minutes per full chunk
    names = [dry] if ARGS.dry_run else ["full", "chunk0", "chunk1", "chunk2", "chunk3"]
    rows = {}
    for name in names:
        info = DATASET["splitzip"][name]
        a, b = info.get("layers", (0, kv.shape[0]))
        t = kv if name == "full" else kv[a:b, :, info["tokens"][0] : info["tokens"][1]].contiguous()
        x = t.to(DEVICE)
        payload = g.encode_splitzip_gpu(x)
        host = payload.cpu().numpy().tobytes()
        row = {"values": x.numel(), "payload_bytes": len(host), "ratio": round(2 * x.numel() / len(host), 4)}
        row["equals_cpu_codec_sha256"] = hashlib.sha256(host).hexdigest() == info["payload"]["sha256"]
        ref = splitzip_ref.encode_bf16(bits16(t))
        row["equals_numpy_reference"] = host == ref
        back = g.decode_splitzip_gpu(ref, x.numel(), device=DEVICE)
        row["decode_of_reference_bit_exact"] = bool(np.array_equal(bits16(back), bits16(t)))
        back2 = g.decode_splitzip_gpu(payload, x.numel())
        row["decode_of_own_payload_bit_exact"] = bool(torch.equal(back2.view(torch.int16), x.reshape(-1).view(torch.int16)))
        try:
            from vllm_kvcodec.format.device_chunks import SplitZipGPU  # needs the chunk format: xxhash, every codec's imports
        except Exception as exc:  # noqa: BLE001
            row["chunk_blob_equals_cpu"] = f"skipped (chunk format not importable: {type(exc).__name__}: {exc})"
        else:
            blob = SplitZipGPU().encode_chunk_gpu(x)
            row["chunk_blob_equals_cpu"] = hashlib.sha256(blob).hexdigest() == info["chunk"]["sha256"]
            dec = SplitZipGPU().decode_chunk_gpu(blob, DEVICE)
            row["chunk_decode_bit_exact"] = bool(torch.equal(dec.view(torch.int16), x.view(torch.int16)))
        rows[name] = row
        log(f"   {name}: {row}")
    d["payloads"] = rows
    bad = [n for n, r in rows.items() if not all(v is True for k, v in r.items() if k.startswith(("equals", "decode", "chunk_")) and not isinstance(v, str))]
    d["bit_exact"] = not bad
    if bad:
        d["status"] = f"MISMATCH in {bad}"


def _big_input() -> torch.Tensor:
    if DATASET is not None:
        base = DATASET["kv"].reshape(-1)
    else:
        base = (torch.randn(1 << 20) * 0.05).to(torch.bfloat16)
    n = 1 << 14 if ARGS.dry_run else int(ARGS.gb * 1e9 / 2) // 1024 * 1024
    reps = -(-n // base.numel())
    big = base.to(DEVICE).repeat(reps)[:n].contiguous()
    return big


def sec_throughput(d: dict) -> None:
    from vllm_kvcodec.gpu import splitzip_triton as g

    iters = 1 if ARGS.dry_run else ARGS.iters
    x = _big_input()
    n = x.numel()
    nbytes = 2 * n
    d["values"] = n
    d["input_gb"] = round(nbytes / 1e9, 3)
    dst = torch.empty_like(x)
    copy = timed(lambda: dst.copy_(x), iters)
    d["copy"] = {"input_GBps": gbps(nbytes, copy["median_s"]), "read_plus_write_GBps": gbps(2 * nbytes, copy["median_s"])}
    del dst
    log(f"   device copy: {d['copy']['input_GBps']} GB/s of input ({d['copy']['read_plus_write_GBps']} GB/s read+write)")

    for hist in ("full", "window"):
        t = timed(lambda: g._codebook_on_device(g._Launcher(DEVICE), x.view(torch.int16), hist, None), iters)
        d[f"histogram_{hist}_GBps"] = gbps(nbytes, t["median_s"])
    log(f"   histogram+codebook alone: full {d['histogram_full_GBps']} GB/s, window {d['histogram_window_GBps']} GB/s")

    reference = g.encode_splitzip_gpu(x)
    d["payload_bytes"] = reference.numel()
    d["ratio"] = round(nbytes / reference.numel(), 4)
    enc_rows = []
    for cfg in ENCODE_CONFIGS[:2] if ARGS.dry_run else ENCODE_CONFIGS:
        try:
            same = torch.equal(g.encode_splitzip_gpu(x, **cfg), reference)
            t = timed(lambda: g.encode_splitzip_gpu(x, **cfg), iters)
            row = {"config": cfg, "GBps": gbps(nbytes, t["median_s"]), "best_GBps": gbps(nbytes, t["min_s"]),
                   "same_bytes": same}
        except Exception as exc:  # noqa: BLE001
            row = {"config": cfg, "error": f"{type(exc).__name__}: {exc}"}
        enc_rows.append(row)
        log(f"   encode {row}")
    d["encode"] = enc_rows

    out = torch.empty_like(x)
    dec_rows = []
    for cfg in DECODE_CONFIGS[:2] if ARGS.dry_run else DECODE_CONFIGS:
        try:
            t = timed(lambda: g.decode_splitzip_gpu_async(reference, n, out, **cfg), iters)
            t_checked = timed(lambda: g.decode_splitzip_gpu(reference, n, out, **cfg), iters)
            exact = torch.equal(out.view(torch.int16), x.view(torch.int16))
            row = {"config": cfg, "GBps": gbps(nbytes, t["median_s"]), "best_GBps": gbps(nbytes, t["min_s"]),
                   "GBps_with_check_sync": gbps(nbytes, t_checked["median_s"]), "bit_exact": exact}
        except Exception as exc:  # noqa: BLE001
            row = {"config": cfg, "error": f"{type(exc).__name__}: {exc}"}
        dec_rows.append(row)
        log(f"   decode {row}")
    d["decode"] = dec_rows
    del out, reference

    # One real 256-token chunk (5.9 MB): what the connector encodes and decodes per call.
    if DATASET is not None:
        chunk = DATASET["kv"][:2, :, :8] if ARGS.dry_run else DATASET["kv"][:, :, :256]
        chunk = chunk.contiguous().to(DEVICE)
        cp = g.encode_splitzip_gpu(chunk)
        cout = torch.empty(chunk.numel(), dtype=torch.bfloat16, device=DEVICE)
        te = timed(lambda: g.encode_splitzip_gpu(chunk), iters)
        td = timed(lambda: g.decode_splitzip_gpu_async(cp, chunk.numel(), cout), iters)
        d["chunk_256_tokens"] = {"shape": list(chunk.shape), "bytes": chunk.numel() * 2, "encode_us": round(te["median_s"] * 1e6, 1),
                                 "decode_us": round(td["median_s"] * 1e6, 1),
                                 "encode_GBps": gbps(chunk.numel() * 2, te["median_s"]),
                                 "decode_GBps": gbps(chunk.numel() * 2, td["median_s"])}
        log(f"   one 256-token chunk: {d['chunk_256_tokens']}")

    # Worst case for the escape path: uniformly random bits (3 in 4 values escape).
    m = n // 8 if not ARGS.dry_run else 1 << 12
    rnd = torch.randint(-32768, 32768, (m,), dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    p = g.encode_splitzip_gpu(rnd)
    t_e = timed(lambda: g.encode_splitzip_gpu(rnd), max(1, iters // 3))
    t_d = timed(lambda: g.decode_splitzip_gpu(p, m), max(1, iters // 3))
    d["random_bits"] = {"values": m, "ratio": round(2 * m / p.numel(), 4), "encode_GBps": gbps(2 * m, t_e["median_s"]),
                        "decode_GBps": gbps(2 * m, t_d["median_s"])}
    log(f"   random bits: {d['random_bits']}")

    best_enc = max((r.get("GBps", 0) for r in enc_rows), default=0)
    best_dec = max((r.get("GBps", 0) for r in dec_rows), default=0)
    REPORT["targets"] = {
        "encode_GBps": best_enc, "encode_target": TARGET_ENCODE_GBPS, "encode_met": best_enc >= TARGET_ENCODE_GBPS,
        "decode_GBps": best_dec, "decode_target": TARGET_DECODE_GBPS, "decode_met": best_dec >= TARGET_DECODE_GBPS,
        "copy_input_GBps": d["copy"]["input_GBps"],
    }
    if not all(r.get("same_bytes", False) for r in enc_rows) or not all(r.get("bit_exact", False) for r in dec_rows):
        d["status"] = "MISMATCH between settings (see rows)"


#: Paged-cache geometries for the scatter section: (name, layers, kv heads, head size, block size, cache blocks).
SCATTER_MODELS = [
    ("smollm2-135m", 30, 3, 64, 16, 8192),   # the model whose real KV the data file holds
    ("llama3-8b", 32, 8, 128, 16, 4096),     # a common 8B GQA geometry (8.6 GB of bf16 cache)
]
SCATTER_TOKENS = 4096  # 16 chunks of 256 tokens, every layer: what a long prefix hit loads
DRY_SCATTER_MODELS = [("tiny", 2, 2, 64, 16, 24)]


def _packed_caches(layers: int, blocks: int, heads: int, block: int, head: int, order: str) -> list:
    """Logical [blocks, heads, block, 2*head] views of one allocation (vLLM 0.33: NHD = LBNHC, HND = LBHNC)."""
    shape = (layers, blocks, block, heads, 2 * head) if order == "NHD" else (layers, blocks, heads, block, 2 * head)
    whole = torch.randint(-32768, 32767, shape, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    return [whole[i].transpose(1, 2) if order == "NHD" else whole[i] for i in range(layers)]


def _scatter_kv(layers: int, tokens: int, heads: int, head: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, head] bf16: real KV where the geometry is SmolLM2's, random bits otherwise."""
    if DATASET is not None and tuple(DATASET["kv"].shape[3:]) == (heads, head) and DATASET["kv"].shape[0] >= layers:
        base = DATASET["kv"][:layers]
        reps = -(-tokens // base.shape[2])
        return base.repeat(1, 1, reps, 1, 1)[:, :, :tokens].contiguous().to(DEVICE)
    return torch.randint(-32768, 32767, (layers, 2, tokens, heads, head), dtype=torch.int16, device=DEVICE).view(torch.bfloat16)


def _copy_gbps(kv: torch.Tensor, iters: int) -> float:
    dst = torch.empty_like(kv)
    return gbps(kv.numel() * 2, timed(lambda: dst.copy_(kv), iters)["median_s"])


def _scatter_row(kv: torch.Tensor, slots: torch.Tensor, blocks: int, block: int, order: str, iters: int) -> dict:
    from vllm_kvcodec.gpu.scatter_triton import PackedPages
    from vllm_kvcodec.paged import Geometry, PackedKVLayout

    layers, _, _, heads, head = kv.shape
    nbytes = kv.numel() * 2
    caches = _packed_caches(layers, blocks, heads, block, head, order)
    want = [c.clone() for c in caches]
    pages = PackedPages(caches, head)
    layout = PackedKVLayout(Geometry(heads, head, block, torch.bfloat16))
    t = timed(lambda: pages.scatter(0, kv, slots), iters)
    ta = timed(lambda: [layout.scatter(want[i], slots, kv[i], check=False) for i in range(layers)], iters)
    sync()
    exact = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(caches, want))
    out = torch.empty_like(kv)
    tg = timed(lambda: pages.gather(0, slots, out), iters)
    return {"triton_scatter_GBps": gbps(nbytes, t["median_s"]), "triton_gather_GBps": gbps(nbytes, tg["median_s"]),
            "layout_scatter_GBps": gbps(nbytes, ta["median_s"]), "bit_exact_vs_layout": exact,
            "gather_round_trip_bit_exact": torch.equal(out.view(torch.int16), kv.view(torch.int16))}


def sec_scatter(d: dict) -> None:
    """Triton scatter/gather of a layer group per launch vs the layout's torch indexing vs a plain copy."""
    iters = 1 if ARGS.dry_run else ARGS.iters
    rows, exact_all = {}, True
    for name, layers, heads, head, block, blocks in DRY_SCATTER_MODELS if ARGS.dry_run else SCATTER_MODELS:
        tokens = 40 if ARGS.dry_run else SCATTER_TOKENS
        kv = _scatter_kv(layers, tokens, heads, head)
        nbytes = kv.numel() * 2
        gen = torch.Generator().manual_seed(0)
        first = 5  # the first chunk starts inside a block, blocks in random order
        table = torch.randperm(blocks, generator=gen)[: -(-(tokens + first) // block)]
        pos = torch.arange(first, first + tokens)
        slots = (table[pos // block] * block + pos % block).to(DEVICE)
        row = {"layers": layers, "kv_heads": heads, "head_size": head, "block_size": block, "tokens": tokens,
               "kv_bytes": nbytes, "copy_GBps": _copy_gbps(kv, iters)}
        for order in ("NHD", "HND"):
            row[order] = _scatter_row(kv, slots, blocks, block, order, iters)
            exact_all &= row[order]["bit_exact_vs_layout"] and row[order]["gather_round_trip_bit_exact"]
        rows[name] = row
        log(f"   {name}: {row}")
    d["models"] = rows
    d["note"] = ("vLLM 0.33 packed K||V (FLASH_ATTN/FLASHINFER); Triton: one launch per layer group through a pointer "
                 "table; layout: PackedKVLayout torch indexing, one layer per call; copy: contiguous d2d of the same bytes")
    d["bit_exact"] = exact_all
    if not exact_all:
        d["status"] = "MISMATCH (see rows)"


def _save_back(caches: list, layouts: list, sc, kv: torch.Tensor, chunk: int) -> dict:
    """Gather the loaded chunks back through the save path: CudaSaveGather -> the real Saver -> a memory store.

    The product's Saver (raw codec, so the stored bytes are the gathered ones)
    rather than a stand-in: a change of what the gather hands the Saver breaks
    this check in the CI dry run, not on the device.
    """
    from storage import open_store
    from vllm_kvcodec.save.codec_choice import CodecChooser
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.save.cuda_gather import CudaSaveGather
    from vllm_kvcodec.save.saver import Saver
    from vllm_kvcodec.stats import ConnectorStats
    from vllm_kvcodec.tools import gpu_load_check as lc

    store = open_store(f"memory://gpu-check-save-{time.monotonic_ns()}")
    outcomes: list = []
    saver = Saver(store, sc.addresses, CodecChooser("raw"), 1, 1 << 40, ConnectorStats(), outcomes.append)
    save = CudaSaveGather(caches, layouts, saver)
    loaded = [c for spec in sc.specs for c in spec.chunks if c.first_token == 0]
    try:
        lc.save_chunks(save, caches, loaded)
    finally:
        save.shutdown()
        saver.shutdown(remaining_s(60))
    exact = True
    for c in loaded:
        at = sc.index[c.chunk_hash] * chunk
        for g, layers in enumerate(sc.addresses.groups):
            key = sc.addresses.key(c.chunk_hash, g)
            blob = store.get(key)
            want = kv[layers.start : layers.stop, :, at : at + chunk]
            exact &= blob is not None and torch.equal(lc.bits(decode_chunk(blob, key=key)), lc.bits(want))
    return {"save_gather_bit_exact": bool(exact) and len(outcomes) == len(loaded),
            "saves_landed": sum(o.landed for o in outcomes), "saves_expected": len(loaded)}


def sec_gpu_fetcher(d: dict) -> None:
    """Real KV chunks (splitzip and CPU codecs) in a memory store -> CudaFetcher -> packed caches -> gather -> compare."""
    from vllm_kvcodec.tools import gpu_load_check as lc
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.paged import PackedKVLayout
    from vllm_kvcodec.stats import ConnectorStats

    if DATASET is None:
        d["status"] = "skipped: no data file"
        return
    if ARGS.dry_run:
        kv, chunk, per_object, block, threads = DATASET["kv"][:4, :, :64].contiguous(), 16, 2, 8, 2
    else:
        kv, chunk, per_object, block, threads = DATASET["kv"], 256, 10, 16, 4
    codecs = ["splitzip", "raw"]  # device decode, and CPU decode + H2D (rans would add a numba JIT warm-up here)
    ok = True
    for order in lc.ORDERS:
        sc = lc.build(kv, chunk_size=chunk, layers_per_object=per_object, block_size=block, codecs=codecs, first_token=37 % chunk)
        caches = sc.caches(DEVICE, order)
        layouts = [PackedKVLayout(sc.geometry)] * len(caches)
        stats = ConnectorStats()
        fetcher = CudaFetcher(sc.store, sc.addresses, caches, layouts, threads, stats)
        try:
            sync()
            t0 = time.perf_counter()
            job = fetcher.submit(sc.specs, remaining_s(120))
            ready_ms, snapshots = [], {}
            for layer in range(len(caches)):
                assert job.wait_layer(layer, job.deadline), f"layer {layer} not ready"
                ready_ms.append(round((time.perf_counter() - t0) * 1e3, 2))
                snapshots[layer] = caches[layer].clone()  # on the compute stream, right after its event wait
            assert job.done.wait(remaining_s(120)), "load not done"
            job.settle()
            sync()
            seconds = time.perf_counter() - t0
            totals = stats.totals()
            want = sc.expected()
            row = {
                "objects": totals.get("loaded_objects", 0), "device_decoded": totals.get("gpu_decoded_objects", 0),
                "failed_blocks": sorted(job.failed_blocks), "group_events_recorded": (all(e is not None for e in job.events) if DEVICE.type == "cuda"
                                          else "n/a: a CPU has no streams (dry run)"),
                "bit_exact_vs_cpu_layout": lc.caches_equal(caches, want),
                "compute_stream_saw_each_layer_after_its_event": all(
                    torch.equal(lc.bits(snapshots[i].cpu()), lc.bits(want[i])) for i in snapshots),
                "raw_GBps_end_to_end": gbps(int(totals.get("loaded_raw_bytes", 0)), seconds),
                "layer_ready_ms": [ready_ms[g.start] for g in sc.addresses.groups],
                "decode_s": round(totals.get("decode_s", 0), 4), "scatter_s": round(totals.get("scatter_s", 0), 4),
            }
            # gather back through the save path (side stream, pinned D2H, the real Saver) and compare with the KV
            row.update(_save_back(caches, fetcher.layouts, sc, kv, chunk))
        finally:
            fetcher.shutdown()
        good = (not row["failed_blocks"] and row["group_events_recorded"] is not False and row["bit_exact_vs_cpu_layout"]
                and row["compute_stream_saw_each_layer_after_its_event"] and row["save_gather_bit_exact"])
        ok &= good
        d[order] = row
        log(f"   {order}: {row}")
    # A payload with a valid checksum but invalid escape positions: caught by the device flags, never written.
    sc = lc.build(kv, chunk_size=chunk, layers_per_object=per_object, block_size=block, codecs=["splitzip"], seed=9)
    bad = sc.specs[0].chunks[0]
    key = sc.addresses.key(bad.chunk_hash, 0)
    sc.store.put(key, lc.swap_escape_positions(sc.store.get(key), key))
    caches = sc.caches(DEVICE)
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, [PackedKVLayout(sc.geometry)] * len(caches), threads,
                          ConnectorStats())
    try:
        job = fetcher.submit(sc.specs, remaining_s(120))
        assert job.done.wait(remaining_s(120)), "load not done"
        job.settle()
        sync()
    finally:
        fetcher.shutdown()
    d["invalid_payload"] = {
        "failed_blocks_as_expected": job.failed_blocks == set(bad.block_ids),
        "nothing_written_for_it": lc.caches_equal(caches, sc.expected({(bad.chunk_hash, 0)})),
    }
    ok &= all(d["invalid_payload"].values())
    log(f"   invalid payload: {d['invalid_payload']}")
    d["bit_exact"] = ok
    if not ok:
        d["status"] = "MISMATCH (see rows)"


def sec_nvcodec(d: dict) -> None:
    from vllm_kvcodec.format import device_chunks
    from vllm_kvcodec.gpu import nvcodec

    ok, reason = nvcodec.nvdec_available()
    d["nvdec"] = {"available": ok, "reason": reason}
    d["PyNvVideoCodec"] = "absent" if "not importable" in reason else "present"
    log(f"   NVDEC: {ok} ({reason})")
    video = (DATASET or {}).get("video")
    if video is None:
        d["nvdec"]["decode"] = "skipped: no video chunk in the data file"
        return
    blob = video["blob"].numpy().tobytes()
    payload = memoryview(blob)[video["payload_offset"] : video["payload_offset"] + video["payload_length"]]
    shape = tuple(video["shape"])
    a, b = video["tokens"]
    want = DATASET["kv"][:, :, a:b].contiguous()
    if not ok:
        d["nvdec"]["decode"] = "skipped: " + reason
        if ARGS.dry_run:  # the code around the decoder, with libav in NVDEC's place
            d["dry_run_libav_in_place_of_nvdec"] = _libav_stand_in(device_chunks, payload, shape, want)
            log(f"   dry run, libav in place of NVDEC: {d['dry_run_libav_in_place_of_nvdec']}")
        return
    try:
        import xxhash  # noqa: F401

        verify = True
    except ImportError:
        verify = False
    from vllm_kvcodec.gpu.nvdec_sessions import NvdecSession, SessionPool

    session = SessionPool(lambda: NvdecSession(DEVICE), 1)  # decoders reused: throughput is in nvdec_decode
    got = device_chunks.decode_video_payload_nvdec(payload, shape, DEVICE, verify_hash=verify, session=session)
    again = device_chunks.decode_video_payload_nvdec(payload, shape, DEVICE, verify_hash=verify, session=session)
    parsed = device_chunks.parse_video_payload(payload, shape)
    d["nvdec"]["decode"] = {
        "bit_exact": bool(torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))),
        "bit_exact_reusing_the_session": bool(torch.equal(again.cpu().view(torch.int16), want.view(torch.int16))),
        "exp_hash_checked": verify, "values": want.numel(), "blob_bytes": len(blob),
        "pictures": [parsed.frames, parsed.width, parsed.height], "throughput": "see section nvdec_decode",
    }
    log(f"   NVDEC decode: {d['nvdec']['decode']}")
    try:
        chunk = device_chunks.decode_video_chunk_nvdec(blob, DEVICE, verify_hash=verify, session=session)
        d["nvdec"]["chunk_level_bit_exact"] = bool(torch.equal(chunk.cpu().view(torch.int16), want.view(torch.int16)))
    except Exception as exc:  # noqa: BLE001 - the chunk format needs xxhash and every codec's imports
        d["nvdec"]["chunk_level_bit_exact"] = f"not run: {type(exc).__name__}: {exc}"
    session.close()


def sec_nvenc(d: dict) -> None:
    """The NVENC probe, after every NVDEC figure: it loads libnvidia-encode, absent on H200s (no NVENC there)."""
    from vllm_kvcodec.format.device_chunks import parse_video_payload
    from vllm_kvcodec.gpu import nvcodec, nvdec_sessions

    ok_enc, reason_enc = nvcodec.nvenc_available()
    d["nvenc"] = {"available": ok_enc, "reason": reason_enc}
    log(f"   NVENC: {ok_enc} ({reason_enc})")
    video = (DATASET or {}).get("video")
    if not ok_enc or video is None or not nvcodec.nvdec_available()[0]:
        return
    blob = video["blob"].numpy().tobytes()
    payload = memoryview(blob)[video["payload_offset"] : video["payload_offset"] + video["payload_length"]]
    from vllm_kvcodec.codecs.video_layout import to_planes

    parsed = parse_video_payload(payload, tuple(video["shape"]))
    a, b = video["tokens"]
    want = DATASET["kv"][:, :, a:b].contiguous()
    exps = ((bits16(want) >> 7) & 0xFF).astype(np.uint8)
    planes = to_planes(exps, parsed.geometry)
    stream = nvcodec.nvenc_encode_planes(planes)
    back = nvdec_sessions.nvdec_decode_planes(stream, parsed.width, parsed.height, parsed.frames, DEVICE)
    d["nvenc"]["roundtrip_bit_exact"] = bool(np.array_equal(back.cpu().numpy(), planes))
    d["nvenc"]["stream_bytes"] = len(stream)


def _libav_stand_in(device_chunks, payload, shape, want) -> str:
    try:
        import av  # noqa: F401  (the stand-in decodes with PyAV, which the device image lacks)
        from vllm_kvcodec.codecs import video_av
    except Exception as exc:  # noqa: BLE001
        return f"not run: {type(exc).__name__}: {exc}"
    sizes = device_chunks.parse_video_payload(payload, shape).packet_sizes

    def planes(stream, width, height, frames, device):
        packets, at = [], 0
        for s in sizes:
            packets.append(memoryview(stream)[at : at + s])
            at += s
        return torch.from_numpy(video_av.decode_pictures(packets, "hevc", width, height)).to(device)

    got = device_chunks.decode_video_payload_nvdec(payload, shape, DEVICE, planes_decoder=planes)
    return "bit-exact" if torch.equal(got.view(torch.int16), want.view(torch.int16)) else "MISMATCH"


def _load_sections(name: str):
    """benchmarks/``name``.py (the KVCodec measurements, the lossy path's), by path: this file may run as a module
    too."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


video_sections = _load_sections("gpu_check_video")
video_sections.DATA = ARGS.data  # the same input file as the other sections (--data)
lossy_sections = _load_sections("gpu_check_lossy")
lossy_sections.video = video_sections  # its data file, timing and NVDEC sessions

#: In the order they run; each is isolated (its failure is recorded, the next one runs). The KVCodec paper's own
#: figures (NVDEC, a video load, the GEMM under each decoder) run right after env, before the sweeps and the first
#: numba/Triton compiles of the other sections, so a slow cold cache skips those instead; then the lossy path's
#: (the paper's operating point: the dequantising scatter, a lossy load, NVDEC of the int8 integers). Whatever loads a
#: driver library that may be missing (the NVENC probe) runs after every figure that does not need it:
#: ("nvenc", sec_nvenc) stays last. Each is ``fn(data: dict)``.
SECTIONS = [
    ("env", sec_env),
    ("nvdec_decode", video_sections.sec_nvdec_decode),
    ("video_fetcher", video_sections.sec_video_fetcher),
    ("sm_interference", video_sections.sec_sm_interference),
    ("lossy_scatter", lossy_sections.sec_lossy_scatter),
    ("lossy_fetcher", lossy_sections.sec_lossy_fetcher),
    ("lossy_nvdec", lossy_sections.sec_lossy_nvdec),
    ("selftest", sec_selftest),
    ("realkv", sec_realkv),
    ("throughput", sec_throughput),
    ("scatter", sec_scatter),
    ("gpu_fetcher", sec_gpu_fetcher),
    ("nvcodec", sec_nvcodec),
    ("nvenc", sec_nvenc),
]


def main() -> int:
    log(f"gpu_check {'DRY RUN (interpreter, CPU, tiny sizes)' if ARGS.dry_run else 'on ' + str(DEVICE)}; report -> {out_path()}")
    if not ARGS.dry_run and not torch.cuda.is_available():
        REPORT["sections"]["env"] = {"status": "error: no CUDA device (use --dry-run on a CPU)"}
        write_report()
        log("no CUDA device")
        return 2
    REPORT["budget_s"] = ARGS.budget_s
    start_watchdog()
    for name, fn in SECTIONS:
        run_section(name, fn)
    t = REPORT.get("targets", {})
    if t:
        log(f"TARGET SplitZip encode >= {TARGET_ENCODE_GBPS:.0f} GB/s: best {t['encode_GBps']} GB/s "
            f"-> {'MET' if t['encode_met'] else 'MISSED'} (device copy {t['copy_input_GBps']} GB/s of input)")
        log(f"TARGET SplitZip decode >= {TARGET_DECODE_GBPS:.0f} GB/s: best {t['decode_GBps']} GB/s "
            f"-> {'MET' if t['decode_met'] else 'MISSED'}")
    statuses = {k: v.get("status", "?") for k, v in REPORT["sections"].items()}
    REPORT["summary"] = statuses
    write_report()
    for k, v in statuses.items():
        log(f"   {k:11s} {v}")
    log(f"wrote {out_path()}")
    return 0 if all(s == "ok" or s.startswith("skipped") for s in statuses.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
