"""The connector's config: defaults that work, clear errors for bad values, a reference that is current."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.tools.config_reference import render
from vllm_kvcodec.errors import ConfigError


def test_defaults_are_lossless_and_need_no_server() -> None:
    config = ConnectorConfig.from_extra_config(None)
    assert config.store.startswith("file://")
    assert config.codec is None and config.chunk_size == 256 and config.load_mode == "sync"
    from vllm_kvcodec.dtypes import DType
    from vllm_kvcodec.codecs.policy import default_codec_for

    assert default_codec_for(DType.BFLOAT16) == "rans" and default_codec_for(DType.FLOAT16) == "zstd"


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"codec": "gzip"}, "unknown codec 'gzip'"),
        ({"store": "s3://bucket"}, "unknown store scheme 's3'.*file:///path"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"load_mode": "lazy"}, "load_mode"),
        ({"fetch_threads": 0}, "fetch_threads"),
        ({"chunk_sise": 256}, "chunk_sise"),
        ({"codec": {"id": "zstd", "level": 99}}, "zstd level"),
    ],
)
def test_bad_values_name_the_key(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    config = ConnectorConfig.from_extra_config({"chunk_size": 96})
    config.check_block_size(32)
    with pytest.raises(ConfigError, match="multiple of vLLM's block_size 64"):
        config.check_block_size(64)


def test_layer_groups_cover_every_layer_once() -> None:
    config = ConnectorConfig.from_extra_config({})
    groups = config.layer_groups(30)
    assert [i for g in groups for i in g] == list(range(30)) and len(groups) == 6
    assert len(ConnectorConfig.from_extra_config({"layers_per_object": 30}).layer_groups(30)) == 1


def test_configuration_reference_is_current() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == render(), "run: python -m vllm_kvcodec.tools.config_reference > docs/configuration.md"
