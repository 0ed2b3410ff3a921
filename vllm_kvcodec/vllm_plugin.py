"""vLLM's plug-in hook (entry point group ``vllm.general_plugins``, declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers) before it builds a connector, so once the package is installed
``--kv-transfer-config '{"kv_connector": "KVCodecConnector", "kv_role": "kv_both"}'``
finds the connector by name in ``KVConnectorFactory``, with no
``kv_connector_module_path``; a config that names the module path keeps
working (vLLM imports it itself). It must be cheap and safe to call more than
once (vLLM says so of every general plug-in): the class is imported only when
vLLM first asks for it.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVCodecConnector"
CONNECTOR_MODULE = "vllm_kvcodec.connector"


def register() -> None:
    """Make ``KVCodecConnector`` a connector name vLLM knows, and its log lines follow vLLM's logging."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_kvcodec.connector.vllm_logging import follow_vllm_logging

    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # no public "is registered"; register twice raises
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    follow_vllm_logging()
