"""``kvcodec bench quality``: real SmolLM2 at the smallest scale. The lossless control reads exactly 0 / 0 / 1.0,
the JSON has its keys, a lossy level's figures are finite and labelled; no thresholds on figures (the benchmark's)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from vllm_kvcodec.codecs.precision import LOSSY_LABEL, Precision
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.bench.quality import parse_level, through_codec

KEYS = ("delta_nll", "kl_mean", "kl_p99", "top1_agreement", "ratio")


def kvcodec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_kvcodec.tools.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_the_lossless_control_is_exact_and_a_lossy_level_is_measured(tmp_path) -> None:
    out = tmp_path / "quality.json"
    done = kvcodec("bench", "quality", "--precision", "int4", "--prefix-tokens", "256", "--continuation-tokens", "8",
                   "--greedy-tokens", "4", "--windows", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    control, (lossy,) = result["control"], result["results"]
    assert control["bit_exact"] and control["precision"]["name"] == "lossless"
    assert (control["delta_nll"], control["kl_mean"], control["kl_p99"], control["top1_agreement"]) == (0.0, 0.0, 0.0, 1.0)
    assert control["delta_nll_ci95"] == [0.0, 0.0] and control["first_greedy_divergence"] == [None, None]
    assert control["tokens_scored"] == lossy["tokens_scored"] == 2 * 8
    for row in (control, lossy):
        assert all(key in row for key in KEYS)
    assert not lossy["bit_exact"] and lossy["label"] == f"int4 ({LOSSY_LABEL})" and result["label"] == LOSSY_LABEL
    assert all(math.isfinite(lossy[key]) for key in KEYS) and lossy["ratio"] > 1
    assert LOSSY_LABEL in done.stdout


def test_sink_tokens_are_kept_in_the_first_chunk_only(real_kv_1k: torch.Tensor) -> None:
    """The attention sinks are the sequence's first tokens, not every chunk's."""
    kv = real_kv_1k[:, :, :512]
    decoded, sizes = through_codec(kv, Precision("int4", sink_tokens=8, full_layers=2), 256)
    same = decoded.view(torch.int16) == kv.view(torch.int16)
    assert same[:2].all()  # the full layers, in every chunk
    assert same[:, :, :8].all() and not same[2:, :, 256:264].all()
    assert len(sizes) == 2 and sizes[0] > sizes[1]


def test_a_level_with_what_it_keeps() -> None:
    assert parse_level("int4, sink_tokens=4, full_layers=2") == Precision("int4", sink_tokens=4, full_layers=2)
    assert parse_level("INT8") == Precision("int8")
    for bad in ("int5", "int4,sinks=4", "int4,full_layers=-1", "int4,sink_tokens"):
        with pytest.raises(ConfigError):
            parse_level(bad)


@pytest.mark.parametrize("args, says", [
    (("--precision", "lossless"), "lossless is its control"),
    (("--precision", "int4,sinks=4"), "is not sink_tokens=N or full_layers=N"),
    (("--prefix-tokens", "300"), "whole chunks of 256 tokens"),
])
def test_bad_settings_are_one_line_errors(args: tuple[str, ...], says: str) -> None:
    done = kvcodec("bench", "quality", *args)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


ENGINE_KEYS = ("identical_prompts", "prompts", "mean_first_divergence", "token_agreement", "loaded_tokens", "label")


@pytest.mark.engine
def test_through_the_engine_the_lossless_control_is_identical_and_int8_loads_int8_objects(tmp_path) -> None:
    """Greedy tokens through real vLLM engines: the lossless load decodes what vLLM's own prefix cache decodes on
    every prompt, the int8 row's prefixes were loaded from int8 objects, and --engine-only keeps the file's other
    figures. How many int8 tokens differ is the benchmark's measurement, not asserted."""
    out = tmp_path / "quality.json"
    out.write_text(json.dumps({"benchmark": "quality", "results": ["kept"]}))
    done = kvcodec("bench", "quality", "--engine-only", "--precision", "int8", "--engine-prompts", "2",
                   "--engine-prefix-tokens", "256", "--engine-greedy-tokens", "8", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["results"] == ["kept"]
    block = result["engine"]
    control, (int8,) = block["control"], block["results"]
    assert (block["prompts"], block["prefix_tokens"], block["greedy_tokens"]) == (2, 256, 8)
    assert control["identical_prompts"] == control["prompts"] == 2 and control["token_agreement"] == 1.0
    assert control["mean_first_divergence"] is None and control["precision_reads_lossless"] == 2
    assert control["loaded_tokens"] == int8["loaded_tokens"] == 2 * 256
    assert int8["precision_reads_int8"] == 2 and int8["precision"]["name"] == "int8"
    for row in (control, int8, block["noise_floor"]):
        assert all(key in row for key in ENGINE_KEYS)
    assert int8["label"] == f"int8 ({LOSSY_LABEL})" and block["label"] == LOSSY_LABEL
    assert LOSSY_LABEL in done.stdout


@pytest.mark.parametrize("args, says", [
    (("--engine-prefix-tokens", "300"), "must be whole chunks of 256 tokens"),
    (("--engine-prompts", "0"), "must each be at least 1"),
])
def test_bad_engine_settings_are_one_line_errors(args: tuple[str, ...], says: str) -> None:
    done = kvcodec("bench", "quality", "--engine-only", *args)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
