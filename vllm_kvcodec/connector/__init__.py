"""The vLLM connector: a thin facade over a scheduler half and a worker half that share only metadata.

vLLM finds :class:`KVCodecConnector` here, by name through the plug-in
(:mod:`vllm_kvcodec.vllm_plugin`) or through ``kv_connector_module_path:
vllm_kvcodec.connector``. Rooms: ``facade`` (what vLLM calls),
``scheduler_half`` (lookup, planning, outcomes), ``worker_half`` (the step's
loads and saves), ``metadata`` (plans down, outcomes up), ``load_ledger`` and
``save_claims`` (what the scheduler half remembers across requests),
``config``, ``transfer_stats`` and ``prom_metrics`` (what vLLM logs and
exports), ``vllm_logging``, and ``store_access``.

The facade (and with it vLLM) is imported on first use, not with the package:
``kvcodec config`` and the argument checks of ``kvcodec demo``/``serve`` read
:mod:`.config` and answer in a fraction of a second instead of after vLLM's
ten-second import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCodecConnector", "live_connectors"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vllm_kvcodec.connector import facade

        return getattr(facade, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
