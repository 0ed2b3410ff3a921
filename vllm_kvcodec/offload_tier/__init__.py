"""A secondary tier for vLLM's OffloadingConnector: the CPU tier's blocks in this project's stores and codecs.

vLLM loads both from this module: the connector (``"kv_connector":
"KVCodecOffloadingConnector", "kv_connector_module_path":
"vllm_kvcodec.offload_tier"``), which hands the tier the engine's identity and
each request's tokens, and the tier by name from its tier config (``"type":
"KVCodecTier", "module_path": "vllm_kvcodec.offload_tier"``); see docs/tiers.md.
"""

from vllm_kvcodec.offload_tier.connector import KVCodecOffloadingConnector
from vllm_kvcodec.offload_tier.manager import KVCodecTier

__all__ = ["KVCodecOffloadingConnector", "KVCodecTier"]
