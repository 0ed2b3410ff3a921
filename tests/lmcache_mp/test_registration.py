"""How LMCache finds the kvcodec serdes and adapter, and the one-line errors a bad configuration gets."""

from __future__ import annotations

import subprocess
import sys

import pytest
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types

from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.lmcache_mp import SERDES, register_serdes
from vllm_kvcodec.lmcache_mp.l2_adapter import KVCodecL2AdapterConfig


def test_lmcache_imports_the_package_and_sees_every_serde() -> None:
    """In a fresh interpreter, LMCache's own plugin factory imports the package: that alone registers the serdes."""
    code = (
        "from lmcache.v1.distributed.serde import get_registered_serde_types as t\n"
        "from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig, _create_plugin_adapter\n"
        "before = set(t())\n"
        "a = _create_plugin_adapter(PluginL2AdapterConfig.from_dict({'module_path': 'vllm_kvcodec.lmcache_mp',"
        " 'class_name': 'KVCodecL2Adapter', 'adapter_params': {'store': 'memory://reg'}}))\n"
        "print(type(a).__name__, sorted(set(t()) - before))\n"
        "a.close()\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"KVCodecL2Adapter {sorted(SERDES)}"


def test_registering_twice_is_harmless() -> None:
    assert register_serdes() == list(SERDES)
    assert set(SERDES) <= set(get_registered_serde_types())


@pytest.mark.parametrize(
    ("serde", "message"),
    [
        ({"type": "kvcodec-zstd", "level": 99}, "zstd level"),
        ({"type": "kvcodec-rans", "bogus": 1}, "bad parameters for codec 'rans'"),
        ({"type": "kvcodec-auto", "level": 3}, "takes no codec parameters"),
        ({"type": "kvcodec-zstd", "fixed_ratio": 0}, "fixed_ratio"),
        ({"type": "kvcodec-zstd", "fixed_ratio": "1.3"}, "fixed_ratio"),
        ({"type": "kvcodec-zstd", "max_workers": 0}, "max_workers"),
    ],
)
def test_bad_serde_settings_are_one_line_errors(serde: dict, message: str) -> None:
    kwargs = {k: v for k, v in serde.items() if k != "type"}
    with pytest.raises(ConfigError, match=message):
        create_serde_processor(SerdeConfig(type=serde["type"], kwargs=kwargs))


def test_codec_parameters_reach_the_codec() -> None:
    processor = create_serde_processor(SerdeConfig(type="kvcodec-zstd", kwargs={"level": 3, "max_workers": 2}))
    processor.close()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "adapter_params.store"),
        ({"store": "nosuch://x"}, "nosuch"),
        ({"store": "memory://a", "threads": 0}, "threads"),
        ({"store": "memory://a", "codec": "rans"}, "unknown adapter_params"),
    ],
)
def test_bad_adapter_settings_are_one_line_errors(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCodecL2AdapterConfig.from_dict(params)


def test_example_server_configs_parse_and_build_their_serdes() -> None:
    """examples/lmcache_mp_kvcodec.sh: every --l2-adapter parses with LMCache's own parser and its serde builds."""
    import argparse
    import re
    from pathlib import Path

    from lmcache.v1.distributed.config import add_storage_manager_args
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    script = (Path(__file__).parents[2] / "examples" / "lmcache_mp_kvcodec.sh").read_text()
    specs = re.findall(r"--l2-adapter '([^']+)'", script)
    assert len(specs) == 3
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    for spec in specs:
        config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", spec]))
        (adapter,) = config.adapters
        assert adapter.serde_config is not None and adapter.serde_config.type in SERDES
        create_serde_processor(adapter.serde_config).close()
