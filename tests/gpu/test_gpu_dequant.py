"""The dequantising scatter (gpu/dequant_triton.py) as a GPU would run it: compiled for sm_90 here, and on CUDA
(a lossy load through ``CudaFetcher`` on CUDA: tests/gpu/test_gpu_load.py).

Its bit-exactness on real KV runs in Triton's interpreter (tests/gpu/interpreted_gpu_load.py, through
test_gpu_load.py); what the interpreter cannot show is what the compiler makes of ``q * step + min``. Triton's
NVIDIA backend and ``ptxas`` ship in the triton wheel, so the kernel is compiled here for an H100/H200 (sm_90)
without a GPU and its PTX and SASS are read: the product and the sum must stay two instructions (``FMUL``,
``FADD``: two roundings, the reference's), never one ``FFMA``. The same kernel written as the plain expression does
compile to ``FFMA``, with fusion enabled as Triton 3.6 (the device image's) enables it by default: that is why
the kernel uses inline PTX, and why this test can fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

SM90 = 90
_POINTERS = {"keys_ptr": "*u8", "values_ptr": "*u8", "kmin_ptr": "*fp32", "kstep_ptr": "*fp32", "vmin_ptr": "*fp32",
             "vstep_ptr": "*fp32", "kept_ptr": "*i16", "table_ptr": "*i64", "slots_ptr": "*i64"}
#: SmolLM2's head size, bf16 caches: the specialisation a load of its KV compiles.
_CONSTANTS = {"HEAD": 64, "BT": 32, "BD": 64, "VEC": 16, "PTR_ALIGN": 16, "ROW_ALIGN": 16, "OUT": 0}


def _compile_sm90(exact_asm: bool) -> tuple[str, str]:
    """(PTX, SASS) of ``_dequantize_scatter`` for sm_90, pointers 16-byte aligned as the load path hands them."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels are interpreted, not compiled")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this triton cannot compile for a target ({exc})")
    from vllm_kvcodec.gpu.dequant_triton import _dequantize_scatter

    fn = _dequantize_scatter
    constants = {**_CONSTANTS, "EXACT_ASM": exact_asm}
    signature = {n: _POINTERS.get(n, "constexpr" if n in constants else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in _POINTERS}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", SM90, 32), options={"enable_fp_fusion": True})
    except Exception as exc:  # noqa: BLE001 - no NVIDIA backend or ptxas in this triton build
        pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(nvdisasm), cubin.name], capture_output=True, text=True, timeout=120, check=True).stdout
    return compiled.asm["ptx"], sass


def _ops(sass: str, op: str) -> int:
    return len(re.findall(rf"\b{op}\b", sass))


def test_the_dequantising_scatter_keeps_two_roundings_in_sm90_sass() -> None:
    ptx, sass = _compile_sm90(exact_asm=True)
    assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx and "fma.rn.f32" not in ptx
    assert _ops(sass, "FFMA") == 0
    assert _ops(sass, "FMUL") == _ops(sass, "FADD") > 0  # one product and one sum per value, never fused
    plain_ptx, plain_sass = _compile_sm90(exact_asm=False)  # q * step + min as written: what the compiler does to it
    assert "fma.rn.f32" in plain_ptx and _ops(plain_sass, "FFMA") > 0, "the hazard the inline PTX guards against"


def test_the_dequantising_scatter_loads_and_stores_whole_vectors_in_sm90_sass() -> None:
    """The integers, kept bits and scales come 16-byte aligned (the staging layout's sections) and every row starts
    at a multiple of the head size: the loads and stores are 128-bit, as the lossless scatter's are."""
    _, sass = _compile_sm90(exact_asm=True)
    assert _ops(sass, r"STG\.E\.128") == 4  # K and V, 32 tokens x 64 bf16 each, over 128 threads
    assert re.findall(r"\bLDG\.E\.(?:U8|U16|S16)\b", sass) == []  # no integer or kept value loaded one at a time


# ---- on a GPU ---------------------------------------------------------------------------------------------------

cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU" if not torch.cuda.is_available() else "TRITON_INTERPRET=1 in this process",
)


@pytest.mark.gpu
@cuda_kernels
@pytest.mark.parametrize("level", ["int8", "int4"])
def test_cuda_dequantize_scatter_writes_the_reference_bit_for_bit(real_chunks, level) -> None:
    """Compiled on CUDA: a real 256-token chunk, every layer, into packed bf16 caches: the reference CPU decode."""
    from vllm_kvcodec.codecs.precision import Precision
    from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header
    from vllm_kvcodec.format.device_quantized import StagedQuantized, unpack_quantized
    from vllm_kvcodec.gpu.dequant_triton import dequantize_into_pages
    from vllm_kvcodec.gpu.scatter_triton import PackedPages
    from vllm_kvcodec.paged import Geometry, PackedKVLayout
    from vllm_kvcodec.tools import gpu_load_check as lc

    kv = real_chunks[3]
    blob = encode_chunk(kv, precision=Precision(level, sink_tokens=4, full_layers=2))
    head = read_header(blob)
    staged = StagedQuantized.of(*unpack_quantized(blob, head), head)
    host = torch.zeros(staged.nbytes, dtype=torch.uint8)
    staged.write(host)
    layers, _, tokens, heads, dim = kv.shape
    whole = torch.randint(-32768, 32767, (layers, 40, heads, 16, 2 * dim), dtype=torch.int16).view(torch.bfloat16)
    want = [c.clone() for c in whole]
    caches = [c for c in whole.cuda()]
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(40 * 16, generator=gen)[: tokens - 7]
    dequantize_into_pages(PackedPages(caches, dim), 0, staged.on_device(host.cuda()), 7, slots.cuda())
    ref = decode_chunk(blob)
    layout = PackedKVLayout(Geometry(heads, dim, 16, torch.bfloat16))
    for i in range(layers):
        layout.scatter(want[i], slots, ref[i, :, 7:].contiguous())
    torch.cuda.synchronize()
    assert lc.caches_equal(caches, want)
