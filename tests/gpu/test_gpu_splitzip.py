"""Triton SplitZip (vllm_kvcodec/gpu): identical bytes to the CPU codec, strict validation.

The kernels run in Triton's interpreter on the CPU. The interpreter needs
``TRITON_INTERPRET=1`` before triton is first imported in a process (triton's
own library functions are decorated at import), and other test modules may
import triton (through vLLM) without it, so the cases run in ONE child process
(``python -m vllm_kvcodec.tools.gpu_selftest --device cpu``) with the variable set in
the child's environment only: it never reaches this process or other modules.
Each case is reported as its own test here. ``@pytest.mark.gpu`` runs the same
cases compiled on CUDA where a GPU exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_kvcodec.codecs.splitzip import SplitZipCodec
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.tools import gpu_selftest as selftest, splitzip_ref

ROOT = Path(__file__).resolve().parents[2]
_ENV_AT_IMPORT = os.environ.get("TRITON_INTERPRET")

REAL_KEYS = ("kv_2layers_8tokens", "kv_odd_1343")
REAL_CASES = tuple(
    f"{kind}[real:{key}]" for key in REAL_KEYS for kind in ("roundtrip", "roundtrip_small_tiles", "roundtrip_hist_window")
)
ALL_CASES = selftest.CASES + REAL_CASES


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _real_slices(kv: torch.Tensor) -> dict[str, np.ndarray]:
    return {
        REAL_KEYS[0]: _bits(kv[:2, :, :8]).reshape(-1),  # 6144 values, layers 0-1, K and V
        REAL_KEYS[1]: _bits(kv[17, 1, 300:308]).reshape(-1)[:1343],  # odd n
    }


def _run_selftest(device: str, data: Path, interpret: bool, timeout: float) -> dict[str, dict]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kvcodec.tools.gpu_selftest", "--device", device, "--data", str(data)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    if not lines:
        raise AssertionError(f"selftest produced no result (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return {r["name"]: r for r in json.loads(lines[-1])}


@pytest.fixture(scope="module")
def real_npz(real_kv_1k: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpu_splitzip") / "real.npz"
    np.savez(path, **_real_slices(real_kv_1k))
    return path


@pytest.fixture(scope="module")
def interpreted(real_npz: Path) -> dict[str, dict]:
    return _run_selftest("cpu", real_npz, interpret=True, timeout=600)


@pytest.mark.parametrize("case", ALL_CASES)
def test_interpreted_kernels(interpreted: dict[str, dict], case: str) -> None:
    assert case in interpreted, f"case {case} did not run"
    result = interpreted[case]
    assert result["ok"], result["detail"]


def test_every_reported_case_is_collected(interpreted: dict[str, dict]) -> None:
    assert set(interpreted) == set(ALL_CASES)


def test_reference_is_the_cpu_codec(real_kv_1k: torch.Tensor) -> None:
    """The numpy reference (used where numba is missing, e.g. the device check) is the CPU codec's payload."""
    codec = SplitZipCodec()
    datasets = dict(selftest._synthetic())
    datasets["real_all"] = _bits(real_kv_1k).reshape(-1)
    datasets.update(_real_slices(real_kv_1k))
    for name, bits in datasets.items():
        payload = codec.encode(bits, DType.BFLOAT16)
        assert splitzip_ref.encode_bf16(bits) == payload, name
        assert np.array_equal(splitzip_ref.decode_bf16(payload, bits.size), bits), name


def test_nothing_set_in_this_process() -> None:
    assert os.environ.get("TRITON_INTERPRET") == _ENV_AT_IMPORT


def test_cuda_without_index_is_the_current_device() -> None:
    """``device="cuda"`` and a tensor on ``cuda:0`` are one device (the check's decode_into_out case failed on that)."""
    from vllm_kvcodec.gpu.launch import resolve_device, same_device

    current = lambda: 0  # noqa: E731 - stands for torch.cuda.current_device() on a machine without CUDA
    assert resolve_device("cuda", current) == torch.device("cuda:0")
    assert same_device("cuda", torch.device("cuda", 0), current)
    assert not same_device("cuda", "cuda:1", current)
    assert same_device("cuda:1", torch.device("cuda", 1), current)
    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "cuda:0", current)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")  # never asks CUDA


def test_package_import_is_light() -> None:
    """Importing vllm_kvcodec.gpu (and nvcodec) pulls in neither triton nor PyNvVideoCodec."""
    code = (
        "import sys, vllm_kvcodec.gpu, vllm_kvcodec.gpu.nvcodec, vllm_kvcodec.tools.gpu_selftest;"
        "print(sorted(m for m in ('triton', 'PyNvVideoCodec') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_on_cuda(real_npz: Path) -> None:
    results = _run_selftest("cuda", real_npz, interpret=False, timeout=900)
    failed = {k: v["detail"] for k, v in results.items() if not v["ok"]}
    assert not failed, failed
    assert set(results) == set(ALL_CASES)
