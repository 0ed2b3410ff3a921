"""Fuzzed decoders: hostile inputs raise only the format's own errors, within an allocation bound.

Property tests over the targets of :mod:`vllm_kvcodec.tools.fuzzing` (seeded from
real SmolLM2 chunks), with Hypothesis driving the mutators. The long run of
the same targets (100k+ inputs, crash and hang watchdog) is
``python -m vllm_kvcodec.tools.bench fuzz``.

Allocation is measured with tracemalloc, which sees numpy's buffers and
Python objects (checked below) but not numba-internal arrays or libav's
picture buffers; the long run also records peak RSS for those.
"""

from __future__ import annotations

import random
import struct
import tracemalloc

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format.container import _FIXED, MAGIC, decode_chunk, encode_chunk
from vllm_kvcodec.tools.fuzzing import HOSTILE_CONFIGS, Case, Target, make_target, reseal, with_config

FAST_CODECS = ["codec-raw", "codec-zstd", "codec-splitzip", "codec-rans", "codec-rans-axis1"]
VIDEO_CODECS = ["codec-video-hevc", "codec-video-h264", "codec-video-ffv1"]


def _target(name: str, kv) -> Target:
    """A target seeded from the first real 256-token chunk, warmed up (numba kernels, libav decoders)."""
    target = make_target(name, kv)
    rng = random.Random(0)
    for seed in target.seeds:
        _decode_measured(target, target.make(seed, rng))
    return target


@pytest.fixture(scope="module")
def chunk_raw(real_chunks) -> Target:
    return _target("chunk-raw", real_chunks[0])


@pytest.fixture(scope="module")
def chunk_resealed(real_chunks) -> Target:
    return _target("chunk-resealed", real_chunks[0])


@pytest.fixture(scope="module", params=FAST_CODECS)
def codec_target(request, real_chunks) -> Target:
    return _target(request.param, real_chunks[0])


@pytest.fixture(scope="module", params=VIDEO_CODECS)
def video_target(request, real_chunks) -> Target:
    return _target(request.param, real_chunks[0])


def _decode_measured(target: Target, case: Case) -> tuple[int, object]:
    """Run the target; any exception but the format's propagates. Returns the traced peak bytes and the output."""
    tracemalloc.start()
    try:
        try:
            out = target.run(case)
        except ChunkFormatError:
            out = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, out


def _check(target: Target, rng) -> None:
    case = target.make(rng.choice(target.seeds), rng)
    peak, out = _decode_measured(target, case)
    assert peak <= case.alloc_bound, (
        f"{target.name}: decode allocated {peak} bytes for {case.declared_nbytes} declared ({case.shape} {case.dtype.name})"
    )
    if target.check is not None:  # decode_into on the same input: what decode returned, or nothing at all
        target.check(case, out)


# No per-example deadline: a 2-core CI box under load (or a first call that compiles numba kernels) made
# 2 s examples flaky; how long hostile inputs take is measured by `kvcodec bench fuzz`, not timed here.
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(rng=st.randoms(use_true_random=False))
def test_decode_chunk_rejects_every_raw_mutation(chunk_raw: Target, rng) -> None:
    """Unsealed mutants of real chunks of every codec: the checksum or header check stops each one."""
    _check(chunk_raw, rng)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_decode_chunk_on_resealed_mutations(chunk_resealed: Target, rng) -> None:
    """Forged headers, hostile codec configs and payloads behind a valid checksum: decode or ChunkFormatError."""
    _check(chunk_resealed, rng)


@FAST
@given(rng=st.randoms(use_true_random=False))
def test_codec_decoder_on_hostile_payloads(codec_target: Target, rng) -> None:
    """Each decoder straight on mutated payloads (fields hit at their offsets), sometimes the wrong shape or dtype."""
    _check(codec_target, rng)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_video_decoder_on_hostile_payloads(video_target: Target, rng) -> None:
    _check(video_target, rng)


def test_tracemalloc_sees_the_decoded_output(real_chunks) -> None:
    """The allocation bound above is only meaningful if the decoders' arrays are traced at all."""
    blob = encode_chunk(real_chunks[0][:4], "splitzip")
    decode_chunk(blob)
    tracemalloc.start()
    try:
        out = decode_chunk(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak >= out.numel() * out.element_size()


@pytest.mark.parametrize("config", HOSTILE_CONFIGS, ids=range(len(HOSTILE_CONFIGS)))
def test_hostile_codec_configs_are_format_errors(real_chunks, config: bytes) -> None:
    """Regression: a deeply nested config JSON escaped as RecursionError before format/container.py caught it."""
    blob = encode_chunk(real_chunks[0][:1, :, :8], "raw")
    with pytest.raises(ChunkFormatError):
        decode_chunk(reseal(with_config(blob, config)))


def test_deeply_nested_config_built_by_hand_is_a_format_error() -> None:
    """The same regression without the fuzzing helpers: a 1500-deep array inside the codec config."""
    config = b'{"id":"raw","x":' + b"[" * 1500 + b"]" * 1500 + b"}"
    payload = bytes(2 * 16)
    body = _FIXED.pack(MAGIC, 1, 1, 3, len(config), 0, len(payload)) + struct.pack("<3I", 2, 2, 4) + config + payload
    with pytest.raises(ChunkFormatError, match="not ASCII JSON"):
        decode_chunk(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


def test_watchdog_aborts_an_input_that_hangs() -> None:
    """The long run's per-input watchdog: a child whose input counter stops moving is aborted, and reported."""
    import multiprocessing
    import time

    from vllm_kvcodec.tools.bench.fuzz import _watch

    ctx = multiprocessing.get_context("spawn")
    progress = ctx.RawValue("q", 0)  # input 0 started and never finishes
    proc = ctx.Process(target=time.sleep, args=(120,))
    proc.start()
    t0 = time.monotonic()
    assert _watch(proc, progress, timeout_s=1.0)
    assert not proc.is_alive() and proc.exitcode != 0
    assert time.monotonic() - t0 < 60


def test_bench_fuzz_writes_json(tmp_path) -> None:
    """`kvcodec bench fuzz`, two targets, a few hundred inputs: every input accounted for, nothing but format errors."""
    import json
    import subprocess
    import sys

    out = tmp_path / "fuzz.json"
    done = subprocess.run(
        [sys.executable, "-m", "vllm_kvcodec.tools.bench", "fuzz", "--inputs", "400", "--target", "chunk-resealed",
         "--target", "codec-rans", "--output", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["clean"] and result["inputs"] == 400
    by_target = {r["target"]: r for r in result["results"]}
    assert all(sum(r["outcomes"].values()) == r["inputs"] > 100 for r in result["results"])
    assert by_target["codec-rans"]["outcomes"].get("CodecError", 0) > 0
    assert by_target["chunk-resealed"]["outcomes"].get("ok", 0) > 0
