"""The package's vLLM plug-in: its entry point, as pyproject.toml declares it, registers the connector by name,
and the connector's log lines go through vLLM's logging.

The entry point is read the way vLLM reads it (``importlib.metadata`` through
vllm.plugins), from a distribution built here out of pyproject.toml, so the
check holds for this checkout whether or not the installed package is
current. tests/tools/test_serve.py does the same through a real ``vllm serve``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import pytest

from tests.support.vllm_server import entry_points_dir


@pytest.fixture
def declared_entry_points(tmp_path: Path):
    sys.path.insert(0, str(entry_points_dir(tmp_path)))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        importlib.invalidate_caches()


def test_the_declared_entry_point_registers_the_connector_with_vllm(declared_entry_points) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert "kvcodec" in plugins
    plugins["kvcodec"]()
    plugins["kvcodec"]()  # vLLM loads plug-ins in every process, possibly more than once
    from vllm_kvcodec.connector import KVCodecConnector

    assert KVConnectorFactory.get_connector_class_by_name("KVCodecConnector") is KVCodecConnector


def test_log_lines_reach_vllms_handler_at_vllms_level() -> None:
    import vllm.logger  # noqa: F401 - configures vLLM's logger, as in every vLLM process

    from vllm_kvcodec.connector.vllm_logging import follow_vllm_logging

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    level = vllm_logger.getEffectiveLevel()  # VLLM_LOGGING_LEVEL (INFO unless set; the test suite may set it)
    try:
        follow_vllm_logging()
        follow_vllm_logging()  # idempotent: one handler, one copy of each line
        logging.getLogger("vllm_kvcodec").log(level, "kvcodec worker: loaded_tokens=1")
        logging.getLogger("vllm_kvcodec.sub").log(level, "from a child logger")
        logging.getLogger("vllm_kvcodec").log(level - 10, "below vLLM's level")
    finally:
        vllm_logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["kvcodec worker: loaded_tokens=1", "from a child logger"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("store,extra,block_size,lines", [
    ("memory://?size=1", {"chunk_sise": 64}, 16, [
        "kvcodec: refusing to start: invalid kv_connector_extra_config for KVCodecConnector: store: unknown option(s) "
        "size in memory://?size=1; known: none",
        "kvcodec: refusing to start: invalid kv_connector_extra_config for KVCodecConnector: chunk_sise: not a key of "
        "KVCodecConnector; did you mean chunk_size? the keys are in docs/configuration.md"]),
    ("memory://", {"chunk_size": 320}, 128, [
        "kvcodec: refusing to start: chunk_size 320 must be a multiple of vLLM's block_size 128; use chunk_size 256 "
        "or 384"]),
])
def test_a_refused_start_up_logs_one_error_line_per_problem_through_vllms_logging(
        tmp_path: Path, store: str, extra: dict, block_size: int, lines: list[str]) -> None:
    """The connector in vLLM's real Scheduler, refused: each problem an ERROR line of its own, before the raise."""
    import vllm.logger  # noqa: F401 - configures vLLM's logger, as in every vLLM process

    from tests.support.scheduler_harness import Engine
    from vllm_kvcodec.errors import ConfigError

    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = seen.append  # type: ignore[method-assign]
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    try:
        with pytest.raises(ConfigError):
            Engine(tmp_path, store, block_size=block_size, **extra)
    finally:
        vllm_logger.removeHandler(handler)
    assert [r.getMessage() for r in seen if r.name == "vllm_kvcodec"] == lines
    assert all(r.levelno == logging.ERROR for r in seen if r.name == "vllm_kvcodec")
