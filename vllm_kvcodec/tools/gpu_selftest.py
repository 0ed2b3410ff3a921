"""Bit-exactness cases for the Triton SplitZip kernels, runnable on a GPU or in Triton's interpreter.

Used by ``tests/gpu/test_gpu_splitzip.py`` (in a child process with
``TRITON_INTERPRET=1``, device ``cpu``; and on CUDA where a GPU exists) and by
``benchmarks/gpu_check.py`` (device ``cuda``). Every case compares against the
CPU codec when it can be imported (it needs numba) and always against the
plain-numpy reference :mod:`vllm_kvcodec.tools.splitzip_ref` (which the tests tie to the CPU
codec byte for byte).

Command line (prints JSON, one result per case)::

    TRITON_INTERPRET=1 python -m vllm_kvcodec.tools.gpu_selftest --device cpu [--data real.npz] [--case NAME ...]

``--data``: an ``.npz`` of uint16 arrays (bfloat16 bit patterns) added as
datasets ``real:<key>``. Importing this module imports neither torch nor
triton, so :data:`CASES` can be listed anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any, Callable

import numpy as np

SMALL = {"tile": 64, "sub": 16, "cap": 16, "tiles_per_scatter": 2, "hist_programs": 3}

#: Synthetic datasets (name -> builder) — adversarial by design.
def _synthetic() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    normal = (rng.standard_normal(4099).astype(np.float32) * 0.05).view(np.uint32)
    specials = np.array(
        [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x007F, 0x7F7F, 0xFF7F, 0x0080, 0x8080],
        dtype=np.uint16,
    )
    mix = np.concatenate([np.tile(specials, 40), rng.integers(0, 65536, 441, dtype=np.uint16)])
    rng.shuffle(mix)
    heavy = ((rng.integers(60, 124, 4000) << 7) | rng.integers(0, 128, 4000) | (rng.integers(0, 2, 4000) << 15)).astype(np.uint16)
    sixteen = ((rng.integers(100, 116, 3000) << 7) | rng.integers(0, 65536, 3000) & 0x807F).astype(np.uint16)
    ties = np.repeat(np.arange(17, dtype=np.uint16) * 3 + 40, 64) << 7  # 17 exponents, equal counts
    rng.shuffle(ties)
    return {
        "normal_bf16": (normal >> 16).astype(np.uint16),  # odd n
        "all_patterns": np.arange(65536, dtype=np.uint16),  # every exponent, sign, mantissa
        "specials": mix,  # +-0, +-Inf, NaNs, subnormals, extremes; 1001 values
        "random_bits": rng.integers(0, 65536, 3001, dtype=np.uint16),
        "escape_heavy": heavy,  # 64 equally likely exponents: 3 in 4 values escape
        "zeros": np.zeros(2048, dtype=np.uint16),
        "sixteen_exponents": sixteen,  # no escape at all
        "tied_counts": ties.astype(np.uint16),
        "n1": np.array([0x3F80], dtype=np.uint16),
        "n1_escape_free_nan": np.array([0xFFC1], dtype=np.uint16),
        "n2": np.array([0x3F80, 0xC000], dtype=np.uint16),
        "n3": np.array([0x0001, 0x7F80, 0x8000], dtype=np.uint16),
        "n17_escapes": (np.arange(17, dtype=np.uint16) << 7) | 0x8001,
    }


# name -> (dataset, encode options, decode options)
def _roundtrip_cases(datasets: dict[str, np.ndarray]) -> dict[str, tuple[str, dict, dict]]:
    cases = {f"roundtrip[{name}]": (name, {}, {}) for name in datasets}
    for name in ("normal_bf16", "random_bits", "escape_heavy", "specials", "n17_escapes"):
        cases[f"roundtrip_small_tiles[{name}]"] = (name, SMALL, {"block_pairs": 16})
    for name in ("normal_bf16", "all_patterns", "escape_heavy"):
        cases[f"roundtrip_hist_window[{name}]"] = (name, {"hist": "window"}, {})
    for name in [k for k in datasets if k.startswith("real:")]:
        cases[f"roundtrip_small_tiles[{name}]"] = (name, SMALL, {"block_pairs": 16})
        cases[f"roundtrip_hist_window[{name}]"] = (name, {"hist": "window"}, {})
    return cases


OTHER_CASES = (
    "decode_device_payload", "decode_into_out", "decode_misaligned", "encode_misaligned_input",
    "invalid_sizes", "invalid_escape_count_device", "invalid_positions_unsorted",
    "invalid_position_out_of_range", "invalid_position_duplicate", "chunk_bytes_equal_cpu",
    "chunk_decode_cpu_blob", "chunk_fallbacks", "async_flags",
)

#: Case names for a run without --data (the tests add ``real:*`` ones).
CASES = tuple(_roundtrip_cases(_synthetic())) + OTHER_CASES


class _Ctx:
    def __init__(self, device: str) -> None:
        import torch

        from vllm_kvcodec.gpu import splitzip_triton
        from vllm_kvcodec.tools import splitzip_ref

        self.torch = torch
        self.g = splitzip_triton
        self.ref = splitzip_ref
        self.device = torch.device(device)
        try:
            from vllm_kvcodec.codecs.splitzip import SplitZipCodec
            from vllm_kvcodec.codecs.dtypes import DType

            codec = SplitZipCodec()
            self.cpu_encode = lambda bits: codec.encode(bits, DType.BFLOAT16)
            self.cpu_decode = lambda payload, n: codec.decode(memoryview(payload), DType.BFLOAT16, (n,))
            self.cpu_name = "cpu codec"
        except Exception as exc:  # noqa: BLE001 - numba (or xxhash...) missing: the reference stands in
            self.cpu_encode = splitzip_ref.encode_bf16
            self.cpu_decode = splitzip_ref.decode_bf16
            self.cpu_name = f"numpy reference (CPU codec not importable: {type(exc).__name__}: {exc})"

    def tensor(self, bits: np.ndarray):
        t = self.torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16).copy())
        return t.view(self.torch.bfloat16).to(self.device)

    def bits(self, t) -> np.ndarray:
        return t.detach().reshape(-1).view(self.torch.int16).cpu().numpy().view(np.uint16)

    def encode_bytes(self, bits: np.ndarray, **options) -> bytes:
        return self.g.encode_splitzip_gpu(self.tensor(bits), **options).cpu().numpy().tobytes()


def _expect_error(fn: Callable[[], Any], error: type, what: str) -> str:
    try:
        fn()
    except error as exc:
        return f"{what}: {type(exc).__name__}: {exc}"
    raise AssertionError(f"{what}: no {error.__name__} raised")


def _case_roundtrip(ctx: _Ctx, bits: np.ndarray, enc: dict, dec: dict) -> str:
    cpu = ctx.cpu_encode(bits)
    ref = ctx.ref.encode_bf16(bits)
    assert ref == cpu, f"numpy reference differs from the {ctx.cpu_name}"
    gpu = ctx.encode_bytes(bits, **enc)
    if gpu != cpu:
        a, b = np.frombuffer(gpu, np.uint8), np.frombuffer(cpu, np.uint8)
        k = min(a.size, b.size)
        diff = np.flatnonzero(a[:k] != b[:k])
        raise AssertionError(f"GPU payload differs: {a.size} vs {b.size} bytes, first differing bytes at {diff[:8].tolist()}")
    out = ctx.g.decode_splitzip_gpu(cpu, bits.size, device=ctx.device, **dec)
    assert np.array_equal(ctx.bits(out), bits), "GPU decode of the CPU payload is not bit-exact"
    back = np.asarray(ctx.cpu_decode(gpu, bits.size)).reshape(-1)
    assert np.array_equal(back, bits), "CPU decode of the GPU payload is not bit-exact"
    m = int.from_bytes(cpu[16:20], "little")
    return f"n={bits.size} m={m} payload={len(cpu)} bytes identical ({ctx.cpu_name})"


def _kv(datasets: dict[str, np.ndarray]) -> np.ndarray:
    real = [v for k, v in datasets.items() if k.startswith("real:")]
    return real[0] if real else datasets["normal_bf16"]


def _other(ctx: _Ctx, name: str, datasets: dict[str, np.ndarray]) -> str:
    torch, g = ctx.torch, ctx.g
    from vllm_kvcodec.errors import CodecError, ConfigError

    bits = datasets["escape_heavy"][:1001]
    n = bits.size
    cpu = ctx.cpu_encode(bits)
    m = int.from_bytes(cpu[16:20], "little")
    pos_at = 20 + (n + 1) // 2 + n

    if name == "decode_device_payload":
        payload = g.encode_splitzip_gpu(ctx.tensor(bits))
        out = g.decode_splitzip_gpu(payload, n)
        assert np.array_equal(ctx.bits(out), bits)
        return f"m={m}"
    if name == "decode_into_out":
        out = torch.full((n + 3,), 7.0, dtype=torch.bfloat16, device=ctx.device)
        got = g.decode_splitzip_gpu(cpu, n, out[1 : 1 + n], device=ctx.device)  # not 4-byte aligned
        assert np.array_equal(ctx.bits(got), bits) and got.data_ptr() == out[1:].data_ptr()
        assert float(out[0]) == 7.0 and float(out[-1]) == 7.0 and float(out[-2]) == 7.0, "wrote outside out"
        aligned = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)
        assert g.decode_splitzip_gpu(cpu, n, aligned, device=ctx.device) is aligned
        assert np.array_equal(ctx.bits(aligned), bits)
        bad = torch.empty(n, dtype=torch.float16, device=ctx.device)
        return _expect_error(lambda: g.decode_splitzip_gpu(cpu, n, bad, device=ctx.device), ConfigError, "fp16 out")
    if name == "decode_misaligned":
        buf = torch.zeros(len(cpu) + 1, dtype=torch.uint8, device=ctx.device)
        buf[1:].copy_(torch.frombuffer(bytearray(cpu), dtype=torch.uint8))
        out = g.decode_splitzip_gpu(buf[1:], n)
        assert np.array_equal(ctx.bits(out), bits)
        return "payload at an odd address"
    if name == "encode_misaligned_input":
        base = ctx.tensor(np.concatenate([[0], bits]))
        assert g.encode_splitzip_gpu(base[1:]).cpu().numpy().tobytes() == cpu
        return "input at a 2-byte offset"
    if name == "invalid_sizes":
        notes = [
            _expect_error(lambda: g.decode_splitzip_gpu(cpu[:-1], n, device=ctx.device), CodecError, "truncated"),
            _expect_error(lambda: g.decode_splitzip_gpu(cpu + b"\0", n, device=ctx.device), CodecError, "one extra byte"),
            _expect_error(lambda: g.decode_splitzip_gpu(cpu + b"\0" * 5, n, device=ctx.device), CodecError, "stored m mismatch"),
            _expect_error(lambda: g.decode_splitzip_gpu(cpu, n + 1, device=ctx.device), CodecError, "wrong n"),
            _expect_error(lambda: g.decode_splitzip_gpu(cpu[:10], 0, device=ctx.device), CodecError, "short header"),
        ]
        return "; ".join(notes)
    if name == "invalid_escape_count_device":
        bad = bytearray(cpu)
        bad[16:20] = (m + 1).to_bytes(4, "little")
        payload = torch.frombuffer(bad, dtype=torch.uint8).to(ctx.device)
        return _expect_error(lambda: g.decode_splitzip_gpu(payload, n), CodecError, "device payload, wrong stored m")
    if name in ("invalid_positions_unsorted", "invalid_position_out_of_range", "invalid_position_duplicate"):
        assert m >= 3
        bad = bytearray(cpu)
        pos = np.frombuffer(bytes(bad[pos_at : pos_at + 4 * m]), dtype="<u4").copy()
        if name == "invalid_positions_unsorted":
            pos[[0, 1]] = pos[[1, 0]]
        elif name == "invalid_position_duplicate":
            pos[2] = pos[1]
        else:
            pos[-1] = 0xFFFFFFF0  # far outside; the kernel must not write there
        bad[pos_at : pos_at + 4 * m] = pos.astype("<u4").tobytes()
        guard = torch.full((n + 64,), 3.0, dtype=torch.bfloat16, device=ctx.device)
        note = _expect_error(lambda: g.decode_splitzip_gpu(bytes(bad), n, guard[:n], device=ctx.device),
                             CodecError, name)
        assert bool((guard[n:] == 3.0).all()), "a bad position wrote past the output"
        return note
    if name == "chunk_bytes_equal_cpu":
        from vllm_kvcodec.format import encode_chunk

        kv = _kv(datasets)
        shape = (2, 2, kv.size // 4) if kv.size % 4 == 0 else (kv.size,)
        t = ctx.tensor(kv).reshape(shape)
        from vllm_kvcodec.format.device_chunks import SplitZipGPU

        blob = SplitZipGPU().encode_chunk_gpu(t)
        assert blob == encode_chunk(t.cpu(), "splitzip"), "GPU chunk blob differs from encode_chunk's"
        return f"shape {shape}, {len(blob)} bytes"
    if name == "chunk_decode_cpu_blob":
        from vllm_kvcodec.format import encode_chunk

        kv = _kv(datasets)
        t = ctx.tensor(kv)
        from vllm_kvcodec.format.device_chunks import SplitZipGPU

        got = SplitZipGPU().decode_chunk_gpu(encode_chunk(t.cpu(), "splitzip"), ctx.device)
        assert got.device.type == ctx.device.type and np.array_equal(ctx.bits(got), kv)
        return f"{kv.size} values"
    if name == "chunk_fallbacks":
        from vllm_kvcodec.format.device_chunks import SplitZipGPU
        from vllm_kvcodec.format import decode_chunk, encode_chunk

        zgpu = SplitZipGPU()
        f32 = torch.randn(3, 5, dtype=torch.float32)
        blob = zgpu.encode_chunk_gpu(f32.to(ctx.device))
        assert blob == encode_chunk(f32, "splitzip") and torch.equal(decode_chunk(blob), f32)
        assert torch.equal(zgpu.decode_chunk_gpu(blob, ctx.device).cpu(), f32)
        raw = encode_chunk(ctx.tensor(bits).cpu(), "raw")
        assert np.array_equal(ctx.bits(zgpu.decode_chunk_gpu(raw, ctx.device)), bits)
        return "float32 chunk via the CPU codec; raw chunk via decode_chunk"
    if name == "async_flags":
        out, err = g.decode_splitzip_gpu_async(cpu, n, device=ctx.device)
        g.raise_if_invalid(err)
        assert np.array_equal(ctx.bits(out), bits)
        return "flags clear"
    raise KeyError(name)


def run_cases(device: str, datasets: dict[str, np.ndarray] | None = None,
              names: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the named cases (default: all) on ``device``; one ``{"name", "ok", "detail"}`` each."""
    import time

    data = _synthetic()
    data.update({f"real:{k}": np.ascontiguousarray(v, dtype=np.uint16).reshape(-1) for k, v in (datasets or {}).items()})
    roundtrips = _roundtrip_cases(data)
    wanted = names or list(roundtrips) + list(OTHER_CASES)
    ctx = _Ctx(device)
    results = []
    for name in wanted:
        t0 = time.perf_counter()
        try:
            if name in roundtrips:
                ds, enc, dec = roundtrips[name]
                detail = _case_roundtrip(ctx, data[ds], enc, dec)
            else:
                detail = _other(ctx, name, data)
            results.append({"name": name, "ok": True, "detail": detail})
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            results.append({"name": name, "ok": False,
                            "detail": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        results[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--data", help=".npz of uint16 arrays (bfloat16 bits), added as real:<key>")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    args = parser.parse_args(argv)
    datasets = dict(np.load(args.data)) if args.data else None
    results = run_cases(args.device, datasets, args.case)
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
