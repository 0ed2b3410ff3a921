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
    from vllm_kvcodec.codecs.dtypes import DType
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
        ({"precision": "int3"}, "precision: Input should be 'lossless', 'int8', 'int6', 'int4' or 'auto'"),
        ({"precision": "int8", "precision_floor": "int4"}, "precision_floor applies to precision auto only"),
        ({"precision_sink_tokens": 4}, "precision_sink_tokens applies to a lossy precision"),
        ({"precision_full_layers": 2}, "precision_full_layers applies to a lossy precision"),
        ({"precision": "int4", "precision_sink_tokens": 300}, "precision_sink_tokens 300 exceeds chunk_size 256"),
        ({"precision": "auto", "precision_load_budget_s": 0}, "precision_load_budget_s"),
    ],
)
def test_bad_values_name_the_key(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_a_lossy_precision_is_checked_against_the_model(caplog) -> None:
    """An fp8 cache is 8-bit already: it stays lossless, said in the log. MLA's latent has no K and V to quantise
    apart, and more full layers than the model has are nonsense: one line each, at start-up."""
    from vllm_kvcodec.connector.precisions import Precisions, resolve_precision

    lossy = ConnectorConfig.from_extra_config({"precision": "auto", "precision_floor": "int4",
                                               "precision_sink_tokens": 4, "precision_full_layers": 2})
    assert resolve_precision(lossy, "bfloat16", 30, use_mla=False) is lossy
    level = Precisions.from_config(lossy)
    assert (level.setting, level.variant, level.level.key()) == ("auto", "int4", "int4+sink4+full2")
    with caplog.at_level("INFO", logger="vllm_kvcodec"):
        fp8 = resolve_precision(lossy, "fp8_e4m3", 30, use_mla=False)
    assert fp8.precision == "lossless" and Precisions.from_config(fp8).level is None
    assert "precision auto: the fp8_e4m3 KV cache is 8-bit already; stored lossless as today" in caplog.text
    with pytest.raises(ConfigError, match="^precision auto quantises keys and values apart; MLA's latent"):
        resolve_precision(lossy, "bfloat16", 30, use_mla=True)
    with pytest.raises(ConfigError, match="^precision_full_layers 2 exceeds the model's 1 layers$"):
        resolve_precision(lossy, "bfloat16", 1, use_mla=False)
    plain = ConnectorConfig.from_extra_config(None)
    assert resolve_precision(plain, "bfloat16", 30, use_mla=True) is plain  # lossless: nothing to check


def test_chunk_size_must_be_a_multiple_of_the_block_size_and_the_hit_alignment() -> None:
    """The messages docs/troubleshooting.md heads its sections with, each with the nearest chunk sizes that fit."""
    config = ConnectorConfig.from_extra_config({"chunk_size": 96})
    assert config.for_engine("kv_both", 32, 32).chunk_size == 96
    with pytest.raises(ConfigError) as err:
        config.for_engine("kv_both", 64, block_from="the --block-size given")
    assert str(err.value) == ("chunk_size 96 must be a multiple of vLLM's block_size 64 (the --block-size given); "
                              "use chunk_size 64 or 128")
    with pytest.raises(ConfigError) as err:
        config.for_engine("kv_both", 32, 64, alignment_from="two groups")
    assert str(err.value) == ("chunk_size 96 must be a multiple of vLLM's prefix-cache hit alignment (64 tokens, "
                              "two groups); use chunk_size 64 or 128")
    with pytest.raises(ConfigError, match="contradicts kv_role"):  # the role is resolved by the same routine
        ConnectorConfig.from_extra_config({"save": True}).for_engine("kv_consumer", 32)


def test_several_problems_read_one_per_line_in_the_checks_own_words() -> None:
    with pytest.raises(ConfigError) as err:
        ConnectorConfig.from_extra_config({"store": "file://tmp/kv", "chunk_sise": 256, "lookup": "lazy"})
    assert str(err.value).splitlines() == [
        "invalid kv_connector_extra_config for KVCodecConnector (3 problems):",
        "  store: file URLs name a local path (file:///abs/path), not host 'tmp': for the directory /tmp/kv write "
        "file:///tmp/kv",
        "  lookup: Input should be 'auto', 'sync' or 'async'",
        "  chunk_sise: not a key of KVCodecConnector; did you mean chunk_size? the keys are in docs/configuration.md",
    ]
    with pytest.raises(ConfigError) as err:
        ConnectorConfig.from_extra_config({"codec": "gzip"})
    assert str(err.value).startswith("invalid kv_connector_extra_config for KVCodecConnector: codec: unknown codec")
    assert "\n" not in str(err.value) and "Value error" not in str(err.value)


@pytest.mark.parametrize("store,message", [
    ("redis://127.0.0.1:6379/0?read_timout=1", "unknown option.*read_timout.*did you mean read_timeout"),
    ("file://tmp/kvstore", "write file:///tmp/kvstore"),
    ("mooncake://m:50051?protocl=tcp", "did you mean protocol"),
    ("cache+redis://h:6379/0?near=file:///nvme/kv", "needs near=.* and near_bytes="),
])
def test_store_urls_are_checked_by_the_store_registry_without_connecting(store: str, message: str,
                                                                         tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"store: .*{message}"):
        ConnectorConfig.from_extra_config({"store": store})
    # a store that is down or does not exist yet passes: the check is of the URL's form, and touches nothing
    missing = tmp_path / "not" / "yet"
    for url in (f"file://{missing}?max_bytes=1GiB&fsync=1", "redis://127.0.0.1:1/0?read_timeout=0.5&prefix=kv/",
                f"cache+redis://127.0.0.1:1/0?near=file://{missing}&near_bytes=1G", "faults+memory://?drop=0.5",
                "link+redis+cluster://127.0.0.1:1?gbps=10&connect_timeout=1", "mooncake://unresolvable.invalid:1"):
        assert ConnectorConfig.from_extra_config({"store": url}).store == url
    assert not missing.parent.exists()


def test_layer_groups_cover_every_layer_once() -> None:
    for per, count in ((5, 6), (7, 5), (30, 1), (1, 30)):
        groups = _namespace(per).layer_groups()
        assert [i for g in groups for i in g] == list(range(30)) and len(groups) == count


@pytest.mark.parametrize("extra,on_cpu,per", [
    ({}, True, 30),  # the default file store into a CPU engine: loads wait whole, one object per chunk
    ({"store": "memory://x"}, True, 30),
    ({}, False, 5),  # a GPU engine streams its layer groups
    ({"load_wait": "layers"}, True, 10),  # a CPU engine: fewer, larger objects, each one's CPU work costs the prefill
    ({"store": "redis://cache:6379/0"}, True, 10),  # a network store's fetches hide under the prefill
    ({"store": "link+file:///tmp/s?gbps=10"}, True, 10),
    ({"store": "redis://cache:6379/0"}, False, 5),
    ({"store": "redis://cache:6379/0", "load_wait": "whole"}, True, 30),  # waits whole by configuration
    ({"store": "redis://cache:6379/0", "load_wait": "whole"}, False, 5),
    ({"share_across_platforms": True}, True, 5),  # canonical objects: GPU and CPU engines must agree
    ({"object_layout": "canonical"}, True, 5),
    ({"layers_per_object": 10}, True, 10),  # as configured
    ({"layers_per_object": 10, "store": "redis://cache:6379/0"}, False, 10),
    ({"layers_per_object": 64}, True, 30),
])
def test_layers_per_object_follow_how_loads_wait(extra: dict, on_cpu: bool, per: int) -> None:
    assert ConnectorConfig.from_extra_config(extra).object_layers(30, on_cpu=on_cpu) == per


def _namespace(per: int):
    from vllm_kvcodec.keys.chain import Namespace

    return Namespace(model_id="m", dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, layout_id="pages-bs16-v1",
                     tp_size=1, chunk_size=256, layers_per_object=per)


def test_configuration_reference_is_current() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == render(), "run: python -m vllm_kvcodec.tools.config_reference > docs/configuration.md"


@pytest.mark.parametrize(
    "role,extra,save,load",
    [
        ("kv_both", {}, True, True),
        (None, {}, True, True),
        ("kv_producer", {}, True, False),
        ("kv_consumer", {}, False, True),
        ("kv_both", {"save": False}, False, True),  # overrides narrow a role
        ("kv_both", {"load": False}, True, False),
        ("kv_consumer", {"load": True, "save": False}, False, True),  # restating a role is no contradiction
    ],
)
def test_kv_role_decides_save_and_load(role: str | None, extra: dict, save: bool, load: bool) -> None:
    config = ConnectorConfig.from_extra_config(extra).for_role(role)
    assert (config.save, config.load) == (save, load)


@pytest.mark.parametrize(
    "role,extra,message",
    [
        ("kv_consumer", {"save": True}, "save: true contradicts kv_role 'kv_consumer'"),
        ("kv_producer", {"load": True}, "load: true contradicts kv_role 'kv_producer'"),
        ("kv_consumer", {"load": False}, "load: false contradicts kv_role 'kv_consumer'"),
        ("kv_producer", {"save": False}, "save: false contradicts kv_role 'kv_producer'"),
    ],
)
def test_a_contradiction_with_kv_role_is_one_line(role: str, extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        ConnectorConfig.from_extra_config(extra).for_role(role)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("store,mode", [("file:///tmp/kv", "sync"), ("memory://", "sync"),
                                        ("link+file:///tmp/kv?gbps=10&rtt_ms=1", "adaptive"),
                                        ("redis://127.0.0.1:6379/0", "adaptive")])
def test_lookup_auto_is_inline_only_for_stores_on_this_host(store: str, mode: str) -> None:
    config = ConnectorConfig.from_extra_config({"store": store})
    assert config.lookup == "auto" and config.lookup_mode() == mode
    assert ConnectorConfig.from_extra_config({"store": store, "lookup": "async"}).lookup_mode() == "async"
    assert ConnectorConfig.from_extra_config({"store": store, "lookup": "sync"}).lookup_mode() == "sync"
