"""A secondary tier for vLLM's OffloadingConnector: the CPU tier's blocks in this project's stores and codecs.

vLLM loads it by name from its tier config (``"type": "KVCodecTier",
"module_path": "vllm_kvcodec.offload_tier"``); see docs/tiers.md.
"""

from vllm_kvcodec.offload_tier.manager import KVCodecTier

__all__ = ["KVCodecTier"]
