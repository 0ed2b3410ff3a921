"""vllm-kvcodec as an LMCache remote storage plug-in (LMCache 0.5.x).

Enable it in an LMCache config, no code::

    remote_storage_plugins: ["kvcodec"]
    extra_config:
      remote_storage_plugin.kvcodec.module_path: vllm_kvcodec.lmcache_plugin
      remote_storage_plugin.kvcodec.class_name: KVCodecConnectorAdapter
      remote_storage_plugin.kvcodec.store: redis://redis-host:6379/0
      remote_storage_plugin.kvcodec.codec: rans       # optional

This package imports lmcache; ``import vllm_kvcodec`` never imports it. See docs/lmcache.md.
"""

from vllm_kvcodec.lmcache_plugin.connector_adapter import KVCodecConnectorAdapter
from vllm_kvcodec.lmcache_plugin.remote_connector import KVCodecRemoteConnector

__all__ = ["KVCodecConnectorAdapter", "KVCodecRemoteConnector"]
