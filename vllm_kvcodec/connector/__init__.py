"""The vLLM connector: a thin facade over a scheduler half and a worker half that share only metadata.

Users' configs name this module (``kv_connector_module_path:
vllm_kvcodec.connector``), so it exports :class:`KVCodecConnector`. Rooms:
``facade`` (what vLLM calls), ``scheduler_half`` (lookup, planning, outcomes),
``worker_half`` (the step's loads and saves), ``metadata`` (plans down,
outcomes up), ``load_ledger`` and ``save_claims`` (what the scheduler half
remembers across requests), ``config``, ``stats`` and ``store_access``.
"""

from vllm_kvcodec.connector.facade import KVCodecConnector, live_connectors

__all__ = ["KVCodecConnector", "live_connectors"]
