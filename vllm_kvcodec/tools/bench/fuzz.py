"""The long fuzz run: many hostile inputs per decoder, each target in its own process.

Targets and mutators are in :mod:`vllm_kvcodec.tools.fuzzing`. Each target runs in
a fresh spawned process, so a crash (a segfault in a numba kernel or libav)
or a hang ends only that target and is reported with the input that caused
it: inputs are rebuilt from ``(seed, target, index)``, and the parent is the
watchdog (a child whose input counter stops moving for ``timeout_s`` gets
SIGABRT, and faulthandler writes its stack).

Per input the child records the outcome (``ok`` or the exception type), the
time, and the peak of ``tracemalloc`` during the decode. tracemalloc sees
Python objects and numpy arrays (numpy reports its buffers to it), which is
every output and intermediate array of the CPU decoders; it does not see
arrays allocated inside numba kernels (rans' exponent residuals, its 4 KiB
decode table) or libav's own picture buffers (capped by ``max_pixels``). The
process's peak RSS (``ru_maxrss``), which sees everything, is recorded
before and after each input, so any step in the high-water mark is charged
to the input that made it.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import multiprocessing
import os
import random
import resource
import signal
import time
import traceback
import tracemalloc
from pathlib import Path
from typing import Any

from vllm_kvcodec.tools.bench.report import console, machine, table, write_json

SEED_TOKENS = 256  # real_kv(256): cached beside the other real-KV tensors
#: share of the inputs each target gets (sums to 100)
WEIGHTS = {
    "chunk-raw": 10, "chunk-resealed": 20, "codec-raw": 6, "codec-zstd": 8, "codec-splitzip": 9,
    "codec-rans": 9, "codec-rans-axis1": 6, "codec-video-hevc": 12, "codec-video-h264": 10, "codec-video-ffv1": 10,
}
RATIO_MIN_DECLARED = 64 << 10  # ratios of smaller outputs are dominated by ALLOC_SLACK-sized fixed costs
SETUP_TIMEOUT_S = 600.0
MAX_FINDINGS = 5


def input_rng(seed: int, target: str, index: int) -> random.Random:
    return random.Random(f"{seed}/{target}/{index}")


def build_case(target: Any, seed: int, index: int) -> Any:
    rng = input_rng(seed, target.name, index)
    return target.make(rng.choice(target.seeds), rng)


# ---- child --------------------------------------------------------------------------------------
def _child(name: str, count: int, seed: int, video: bool, result_path: str, trace_path: str, progress: Any) -> None:
    trace = open(trace_path, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.enable(trace, all_threads=True)  # SIGSEGV/SIGABRT (the watchdog's) print the stack
    from vllm_kvcodec.tools.fuzzing import make_target
    from vllm_kvcodec.tools.smollm2 import real_kv

    target = make_target(name, real_kv(SEED_TOKENS), video)
    _warm_up(target)
    result = _fuzz(target, count, seed, Path(result_path).parent / "fuzz-findings", progress)
    Path(result_path).write_text(json.dumps(result))


def _warm_up(target: Any) -> None:
    """Numba's cached kernels, libav's decoders and first-touch pages, before anything is measured.

    Each seed runs once as it was encoded (mutated ones mostly fail before the
    kernels that write, such as decode_into's), then mutated a few times.
    """
    from vllm_kvcodec.tools.fuzzing import unmutated

    rng = random.Random("warm-up")
    for s in target.seeds:
        target.run(unmutated(target, s))
        for _ in range(4):
            try:
                target.run(target.make(s, rng))
            except Exception:  # noqa: BLE001, S112 - outcomes are counted in the measured run
                continue


def _fuzz(target: Any, count: int, seed: int, findings_dir: Path, progress: Any) -> dict[str, Any]:
    from vllm_kvcodec.tools.fuzzing import is_format_error

    outcomes: collections.Counter[str] = collections.Counter()
    checks_failed: collections.Counter[str] = collections.Counter()
    findings: list[dict[str, Any]] = []
    worst = {"alloc_bytes": 0, "alloc_ratio": 0.0, "violations": 0, "slowest_s": 0.0, "slowest_index": -1,
             "rss_step_bytes": 0, "rss_step_index": -1, "rss_step_declared": 0}
    rss_start = _maxrss()
    tracemalloc.start()
    t_start = time.perf_counter()
    for i in range(count):
        progress.value = i
        case = build_case(target, seed, i)
        rss0 = _maxrss()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        try:
            out = target.run(case)
            outcomes["ok"] += 1
        except Exception as exc:  # noqa: BLE001 - sorting exceptions is the point
            out = None
            outcomes[type(exc).__name__] += 1
            if not is_format_error(exc) and len(findings) < MAX_FINDINGS:
                findings.append(_finding(target.name, i, case, exc, findings_dir))
        peak = tracemalloc.get_traced_memory()[1] - base
        dt = time.perf_counter() - t0
        if target.check is not None:
            try:
                target.check(case, out)
            except Exception as exc:  # noqa: BLE001 - every failed check is a finding
                checks_failed[type(exc).__name__ + " (check)"] += 1
                if len(findings) < MAX_FINDINGS:
                    findings.append(_finding(target.name, i, case, exc, findings_dir))
        del out
        _account(worst, i, case, peak, dt, _maxrss() - rss0)
    seconds = time.perf_counter() - t_start
    tracemalloc.stop()
    bad = {k: v for k, v in outcomes.items() if k != "ok" and not _is_format_error_name(k)} | dict(checks_failed)
    return {"target": target.name, "inputs": count, "seeds": len(target.seeds), "seconds": seconds,
            "outcomes": dict(outcomes), "other_exceptions": bad, "findings": findings, **worst,
            "rss_start_bytes": rss_start, "rss_end_bytes": _maxrss()}


def _account(worst: dict[str, Any], i: int, case: Any, peak: int, dt: float, rss_step: int) -> None:
    worst["alloc_bytes"] = max(worst["alloc_bytes"], peak)
    if peak > case.alloc_bound:
        worst["violations"] += 1
    if case.declared_nbytes >= RATIO_MIN_DECLARED:
        worst["alloc_ratio"] = max(worst["alloc_ratio"], peak / case.declared_nbytes)
    if dt > worst["slowest_s"]:
        worst["slowest_s"], worst["slowest_index"] = dt, i
    if rss_step > worst["rss_step_bytes"]:
        worst["rss_step_bytes"], worst["rss_step_index"], worst["rss_step_declared"] = rss_step, i, case.declared_nbytes


def _is_format_error_name(name: str) -> bool:
    from vllm_kvcodec import errors

    cls = getattr(errors, name, None)
    return isinstance(cls, type) and issubclass(cls, errors.ChunkFormatError)


def _finding(name: str, index: int, case: Any, exc: BaseException, findings_dir: Path) -> dict[str, Any]:
    findings_dir.mkdir(parents=True, exist_ok=True)
    path = findings_dir / f"{name}-{index}.bin"
    path.write_bytes(case.data)
    return {"index": index, "type": type(exc).__name__, "message": str(exc)[:500], "input": str(path),
            "dtype": case.dtype.name, "shape": list(case.shape),
            "traceback": "".join(traceback.format_exception(exc, limit=8))[-3000:]}


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---- parent -------------------------------------------------------------------------------------
def run_target(name: str, count: int, seed: int, video: bool, timeout_s: float, workdir: Path) -> dict[str, Any]:
    """One target in a fresh process, watched; a crash or hang becomes a finding, not a dead run."""
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.RawValue("q", -1)
    result_path, trace_path = workdir / f"{name}.json", workdir / f"{name}.trace.txt"
    result_path.unlink(missing_ok=True)
    proc = ctx.Process(target=_child, args=(name, count, seed, video, str(result_path), str(trace_path), progress))
    proc.start()
    hung = _watch(proc, progress, timeout_s)
    proc.join()
    if result_path.exists() and proc.exitcode == 0:
        return json.loads(result_path.read_text())
    index = int(progress.value)
    trace = trace_path.read_text()[-3000:] if trace_path.exists() else ""
    kind = "hang" if hung else "crash"
    console.print(f"[red]{name}: {kind} at input {index} (exit code {proc.exitcode})[/red]\n{trace}")
    return {"target": name, "inputs": max(index, 0), "failed": kind, "failed_index": index,
            "exitcode": proc.exitcode, "trace": trace, "outcomes": {}, "other_exceptions": {kind: 1}, "findings": []}


def _watch(proc: Any, progress: Any, timeout_s: float) -> bool:
    """Wait for ``proc``; SIGABRT it if one input runs longer than ``timeout_s``. True if it hung."""
    last, since = progress.value, time.monotonic()
    while proc.is_alive():
        proc.join(0.2)
        value = progress.value
        if value != last:
            last, since = value, time.monotonic()
        limit = SETUP_TIMEOUT_S if value < 0 else timeout_s
        if proc.is_alive() and time.monotonic() - since > limit:
            os.kill(proc.pid, signal.SIGABRT)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            return True
    return False


def split_inputs(total: int, names: list[str]) -> dict[str, int]:
    """``total`` inputs shared by weight, exactly (largest remainders get the leftovers)."""
    weights = {n: WEIGHTS.get(n, 5) for n in names}
    scale = sum(weights.values())
    counts = {n: total * w // scale for n, w in weights.items()}
    by_remainder = sorted(names, key=lambda n: -(total * weights[n] % scale))
    for n in by_remainder[: total - sum(counts.values())]:
        counts[n] += 1
    return counts


def run(output: Path | None = None, inputs: int = 100_000, seed: int = 0, timeout_s: float = 30.0,
        video: bool = True, targets: list[str] | None = None) -> dict[str, Any]:
    from vllm_kvcodec.tools.fuzzing import ALLOC_FACTOR, ALLOC_SLACK, target_names

    names = targets or target_names(video)
    counts = split_inputs(inputs, names)
    workdir = (output.parent if output is not None else Path("bench-results")) / "fuzz-work"
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    for name in names:
        with console.status(f"fuzzing {name}: {counts[name]} inputs"):
            results.append(run_target(name, counts[name], seed, video, timeout_s, workdir))
        r = results[-1]
        console.print(f"{name}: {r['inputs']} inputs, {r.get('seconds', 0):.1f} s, {r['outcomes']}")
    total = sum(r["inputs"] for r in results)
    clean = all(not r["other_exceptions"] and not r.get("violations") for r in results)
    result = {"benchmark": "fuzz", "machine": machine(), "seed": seed, "inputs": total,
              "timeout_s": timeout_s, "seconds": time.perf_counter() - t0,
              "alloc_bound": {"factor": ALLOC_FACTOR, "slack_bytes": ALLOC_SLACK,
                              "ratio_min_declared_bytes": RATIO_MIN_DECLARED},
              "clean": clean, "results": results}
    _print(results, total, clean)
    write_json(result, output)
    return result


def _print(results: list[dict[str, Any]], total: int, clean: bool) -> None:
    rows = []
    for r in results:
        o = r["outcomes"]
        fmt_errors = sum(v for k, v in o.items() if k != "ok" and k not in r["other_exceptions"])
        rows.append([r["target"], r["inputs"], o.get("ok", 0), fmt_errors,
                     ", ".join(f"{k} {v}" for k, v in r["other_exceptions"].items()) or "-",
                     r.get("alloc_ratio", 0.0), r.get("alloc_bytes", 0) / 1e6, r.get("violations", 0),
                     r.get("rss_step_bytes", 0) / 1e6, r.get("slowest_s", 0.0) * 1e3])
    table(f"fuzzed decoders: {total} inputs",
          ["target", "inputs", "ok", "format err", "other", "alloc/decl", "alloc MB", "over", "RSS step MB",
           "slowest ms"], rows)
    console.print("clean: only the format's own exceptions, within the allocation bound" if clean
                  else "[red]NOT clean: see findings in the JSON[/red]")
