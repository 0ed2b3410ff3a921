"""The ``ConnectorAdapter`` LMCache loads from ``remote_storage_plugin.kvcodec.module_path/class_name``."""

from __future__ import annotations

from lmcache.logging import init_logger
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from vllm_kvcodec.lmcache_plugin.settings import PLUGIN_TYPE

logger = init_logger(__name__)

SCHEMA = f"plugin://{PLUGIN_TYPE}"


class KVCodecConnectorAdapter(ConnectorAdapter):
    """Builds :class:`KVCodecRemoteConnector` for ``plugin://kvcodec`` and ``plugin://kvcodec.<instance>``.

    LMCache's ``RemoteBackend`` turns each name in ``remote_storage_plugins`` into
    the URL ``plugin://<name>`` and asks every loaded adapter whether it can parse
    it; this one answers for the plug-in type ``kvcodec``.
    """

    def __init__(self) -> None:
        super().__init__(SCHEMA)

    def can_parse(self, url: str) -> bool:
        if not url.startswith("plugin://"):
            return False
        return extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        from vllm_kvcodec.lmcache_plugin.remote_connector import KVCodecRemoteConnector

        plugin_name = context.plugin_name or context.url[len("plugin://"):]
        logger.info("Creating kvcodec connector for %s", plugin_name)
        return KVCodecRemoteConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=plugin_name,
        )
