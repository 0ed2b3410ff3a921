"""The device check (benchmarks/gpu_check.py) runs whole where the GPU image's packages are missing.

The GPU machine's image has torch, triton, numpy, numba, xxhash and cupy, but
no vLLM, pydantic, zstandard, PyAV, redis-py or PyNvVideoCodec, and device
time is a single short window: an import that fails there, or a stand-in that
no longer matches the product's interfaces, costs the window's figures. So the
dry run (Triton's interpreter on CPU tensors, tiny sizes) runs here in a child
process whose imports of exactly those packages fail: a ``sitecustomize.py``
on the child's ``PYTHONPATH`` puts a meta-path finder in front that raises
ImportError for them. Every section must then report ok and reach its
measurement, read from the JSON the check writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.py"

#: What the device image lacks (top-level package names); docs/gpu.md lists the same.
ABSENT_ON_DEVICE = ("vllm", "pydantic", "zstandard", "av", "redis", "PyNvVideoCodec")

SITECUSTOMIZE = f'''
"""Make this process look like the GPU device image: these packages cannot be imported."""
import sys

_ABSENT = {set(ABSENT_ON_DEVICE)!r}


class _AbsentOnDevice:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ImportError(f"No module named {{name!r}} (absent on the device image)")
        return None


sys.meta_path.insert(0, _AbsentOnDevice())
'''

#: Sections the check must have; any others (the video sections) are held to "ok" as well.
SECTIONS = ("env", "selftest", "realkv", "throughput", "scatter", "gpu_fetcher", "nvcodec", "lossy_scatter",
            "lossy_fetcher", "lossy_nvdec")


def _device_like_env(tmp: Path) -> dict[str, str]:
    site = tmp / "device_image"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    env.pop("OUT", None)
    return env


def _run_check(env: dict[str, str], data: Path, out: Path, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--dry-run", "--data", str(data), "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def check_data(real_kv_1k, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """benchmarks/make_gpu_check_data.py's file (real SmolLM2 KV, CPU digests, an HEVC chunk), made here."""
    out = tmp_path_factory.mktemp("gpu_check_data") / "realkv.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_gpu_check_data.py"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def device_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _device_like_env(tmp_path_factory.mktemp("gpu_check_env"))


@pytest.fixture(scope="module")
def report(check_data: Path, device_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check_out") / "gpu_check.json"
    proc = _run_check(device_env, check_data, out)
    assert out.exists(), f"no report (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rep = json.loads(out.read_text())
    rep["_rc"], rep["_log"] = proc.returncode, proc.stdout[-6000:] + proc.stderr[-3000:]
    return rep


@pytest.mark.parametrize("name", ABSENT_ON_DEVICE)
def test_the_child_cannot_import_what_the_device_lacks(device_env: dict[str, str], name: str) -> None:
    """The blocker works (else the dry run below would prove nothing): each of these imports fails in the child."""
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, env=device_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "absent on the device image" in proc.stderr


def test_every_section_reports_ok(report: dict) -> None:
    statuses = {k: v.get("status") for k, v in report["sections"].items()}
    assert set(SECTIONS) <= set(statuses), statuses
    bad = {k: (s, report["sections"][k].get("traceback", "")[-1500:]) for k, s in statuses.items() if s != "ok"}
    assert not bad, f"{bad}\n{report['_log']}"
    assert report["_rc"] == 0, report["_log"]
    assert "ended_by" not in report
    assert report["elapsed_s"] < report["budget_s"]


def test_kvcodec_sections_run_first(report: dict) -> None:
    """NVDEC, the video load and the GEMM interference run right after env (a cold compile cache in the sweeps
    would otherwise skip the paper's own figures first), then the lossy path's; the NVENC probe stays last."""
    order = list(report["sections"])
    assert order[:4] == ["env", "nvdec_decode", "video_fetcher", "sm_interference"], order
    assert order[4:7] == ["lossy_scatter", "lossy_fetcher", "lossy_nvdec"], order  # the paper's operating point next
    assert order[-1] == "nvenc"


def test_video_fetcher_reports_sessions_and_stages(report: dict) -> None:
    """The pool size the product uses (min(NVDEC engines from the caps, fetch threads), whatever the session
    factory) and each stage's seconds: decode, join, checksum (value digest; the old exponent hash beside it),
    scatter, for video and for SplitZip; their checks passed."""
    nd, vf = report["sections"]["nvdec_decode"], report["sections"]["video_fetcher"]
    assert nd["caps"]["source"] == "GetDecoderCaps" and nd["caps"]["engines"] >= 1
    assert vf["sessions"] == min(nd["caps"]["engines"], vf["fetch_threads"]) > 1
    stages = vf["stages"]
    for key in ("decode_s", "join_s", "checksum_s", "checksum_exponent_hash_s", "scatter_s"):
        assert stages[key] > 0, stages
    assert stages["checks_passed"] is True and stages["objects"] == vf["chunks"]
    assert stages["checksum"].startswith("value digest")
    sz = vf["stages_splitzip"]
    assert all(sz[k] > 0 for k in ("decode_s", "checksum_s", "scatter_s")) and sz["checks_passed"] is True
    two = nd["two_sizes"]
    assert two["bit_exact"] is True and two["decoders_created"] == 2 and two["sizes"][0] != two["sizes"][1]


def test_lossy_sections_reach_their_measurements(report: dict) -> None:
    """The lossy path (LOSSY: NOT BIT-EXACT vs the KV): the dequantising scatter of int8 and int4 (sink tokens and a
    full layer kept) objects bit-exact against the CPU decoder in both page orders, beside the lossless scatter's
    GB/s; a CudaFetcher load of lossy objects, every one dequantised on the device; the int8 integers' HEVC
    pictures decoded by the product's NVDEC session (the stand-in here), checked, dequantised bit-exactly."""
    sections = report["sections"]
    scatter = sections["lossy_scatter"]
    assert set(scatter) >= {"int8", "int4_kept"} and scatter["bit_exact"] is True
    for name in ("int8", "int4_kept"):
        for order in ("NHD", "HND"):
            row = scatter[name][order]
            assert row["bit_exact_vs_cpu_decoder"] is True
            assert row["dequantize_scatter_GBps_bf16_out"] > 0 and row["lossless_scatter_GBps"] > 0
        assert scatter[name]["host_unpack_s"] > 0 and scatter[name]["staged_bytes"] < scatter[name]["bf16_bytes"]
    assert scatter["int4_kept"]["codec"]["sink_tokens"] > 0 and scatter["int4_kept"]["codec"]["full_layers"] > 0
    fetcher = sections["lossy_fetcher"]
    assert fetcher["bit_exact_vs_cpu_decoder"] is True and fetcher["failed_blocks"] == 0
    assert fetcher["device_decoded"] == fetcher["objects"] > 0 and fetcher["kv_GBps"] > 0
    nvdec = sections["lossy_nvdec"]
    assert nvdec["decoder"].startswith("PyNvVideoCodec 2.0.4 stand-in, known pictures")  # PyAV blocked, as there
    assert nvdec["bit_exact_integers"] is True and nvdec["bit_exact_pages"] is True
    assert nvdec["integer_check_passed"] and nvdec["one_session"]["pictures_per_s"] > 0


def test_selftest_and_real_kv_reach_their_measurements(report: dict) -> None:
    st = report["sections"]["selftest"]
    assert st["cases"] > 0 and st["passed"] == st["cases"], st["failed"]
    assert not st["skipped_missing_dependency"]
    rows = report["sections"]["realkv"]["payloads"]
    assert rows, "no real-KV payload compared"
    for row in rows.values():
        assert row["equals_cpu_codec_sha256"] is True and row["equals_numpy_reference"] is True
        assert row["decode_of_reference_bit_exact"] is True and row["decode_of_own_payload_bit_exact"] is True
        # the chunk format imports without zstandard: the chunk-level comparison ran, not "skipped"
        assert row["chunk_blob_equals_cpu"] is True and row["chunk_decode_bit_exact"] is True


def test_throughput_and_scatter_reach_their_measurements(report: dict) -> None:
    tp = report["sections"]["throughput"]
    assert tp["encode"] and all(r.get("same_bytes") is True and r["GBps"] > 0 for r in tp["encode"]), tp["encode"]
    assert tp["decode"] and all(r.get("bit_exact") is True and r["GBps"] > 0 for r in tp["decode"]), tp["decode"]
    assert tp["random_bits"]["decode_GBps"] > 0 and tp["chunk_256_tokens"]["decode_GBps"] > 0
    assert report["targets"]["decode_GBps"] > 0
    assert report["sections"]["scatter"]["bit_exact"] is True


def test_gpu_fetcher_loads_and_saves_through_the_product_classes(report: dict) -> None:
    """CudaFetcher with ConnectorStats, and the save gather back through the real Saver: bit-exact."""
    fe = report["sections"]["gpu_fetcher"]
    for order in ("NHD", "HND"):
        row = fe[order]
        assert row["bit_exact_vs_cpu_layout"] is True and not row["failed_blocks"]
        assert row["device_decoded"] > 0 and row["objects"] > row["device_decoded"]  # splitzip on the device, raw not
        assert row["save_gather_bit_exact"] is True and row["saves_landed"] == row["saves_expected"] > 0
    assert all(v is True for v in fe["invalid_payload"].values()), fe["invalid_payload"]


def test_missing_video_library_is_recorded_and_the_check_goes_on(report: dict) -> None:
    nvdec = report["sections"]["nvcodec"]["nvdec"]
    assert nvdec["available"] is False and "absent on the device image" in nvdec["reason"]
    assert report["sections"]["nvcodec"]["PyNvVideoCodec"] == "absent"
    # The NVENC probe (PyNvVideoCodec's import loads the encoder library) is in the last section that runs,
    # after every decode figure; whichever section holds it.
    with_probe = [k for k, v in report["sections"].items() if "nvenc" in v]
    assert with_probe == [list(report["sections"])[-1]], with_probe
    nvenc = report["sections"][with_probe[0]]["nvenc"]
    assert nvenc["available"] is False and "absent on the device image" in nvenc["reason"]
    env = report["sections"]["env"]  # located, never imported before the NVDEC section
    assert env["PyNvVideoCodec"].startswith("absent") and env["zstandard"].startswith("absent")
    assert "lacks the 'video' driver capability" in env["video_driver"]  # no driver library here, as in such a container


def test_budget_ends_a_running_section_and_writes_the_report(report: dict, check_data: Path,
                                                              device_env: dict[str, str], tmp_path: Path) -> None:
    """A run past ``--budget-s`` is ended by the watchdog: the running section says so, the later ones are listed.

    The budget is half of what the full dry run took on this host (a fixed one outlived the whole run on a fast
    host). The full run may have been slowed by a neighbour (another xdist worker's heavy test) and this one not:
    a run that ends inside its budget (exit 0, nothing to check) is tried again at half of it, at most three times,
    so the watchdog fires mid-run however the load changes between the runs."""
    out = tmp_path / "gpu_check.json"
    budget = report["elapsed_s"]
    for _ in range(3):
        budget = max(1.0, round(budget / 2, 1))
        proc = _run_check(device_env, check_data, out, "--budget-s", str(budget), timeout=120)
        if proc.returncode != 0:
            break
    assert proc.returncode == 3, f"budget {budget} s\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ended_by"].startswith(f"time budget of {budget:.0f} s")
    statuses = rep["summary"]
    ended = [k for k, s in statuses.items() if s.startswith("error: time budget")]
    assert len(ended) == 1, statuses
    later = list(statuses)[list(statuses).index(ended[0]) + 1 :]
    assert later and all(statuses[k].startswith("skipped") for k in later), statuses
    assert set(SECTIONS) <= set(statuses)
    assert rep["elapsed_s"] < budget + 5


# ---- the carry (benchmarks/gpu_bundle.py): what the device command and unpack do, without downloading here ----
def _bundle_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "benchmarks" / "gpu_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_device_command_fits_and_runs_the_check_under_its_budget() -> None:
    gb = _bundle_module()
    cmd = gb.device_command()
    assert len(cmd) <= gb.COMMAND_LIMIT
    assert f"--budget-s {gb.CHECK_BUDGET_S}" in cmd and gb.CHECK_BUDGET_S < 360 and gb.RUN_TIMEOUT_S <= 600
    assert '"$OUT/preflight.txt"' in cmd and f"PYTHONPATH={gb.SITE}" in cmd
    proc = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    # what is carried is ignored by git (else it would travel as tracked files and could be committed); asked as
    # folders, so the answer does not depend on whether a bundle was built in this clone
    folders = [f"{path}/" for path in gb.CARRY]
    ignored = subprocess.run(["git", "check-ignore", *folders], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert ignored.stdout.split() == folders


def test_unpack_extracts_the_common_zips_and_this_pythons_only(tmp_path: Path) -> None:
    import zipfile

    wheels = tmp_path / "bundle" / "wheels"
    wheels.mkdir(parents=True)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for name, member in (("pkg-common", "pkg/__init__.py"), (f"pkg-{tag}", f"pkg/_ext_{tag}.py"),
                         ("pkg-cp39", "pkg/_ext_cp39.py"), (f"other-{tag}", "other.py")):
        with zipfile.ZipFile(wheels / f"{name}.zip", "w") as z:
            z.writestr(member, "VALUE = 1\n")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bundle.py"), "unpack", "--to", str(site),
                           "--bundle", str(tmp_path / "bundle")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = sorted(str(p.relative_to(site)) for p in site.rglob("*.py"))
    assert got == ["other.py", "pkg/__init__.py", f"pkg/_ext_{tag}.py"]
