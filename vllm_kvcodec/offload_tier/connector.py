"""``KVCodecOffloadingConnector``: vLLM's OffloadingConnector, telling ``KVCodecTier`` what vLLM tells only it.

Everything vLLM's connector does is unchanged; it only builds itself inside an
:class:`~vllm_kvcodec.offload_tier.engine_context.EngineContext` (so the tier
reads the engine's config while vLLM creates it) and announces every new
request there before vLLM's scheduler half tells its tiers of it (so the tier
can prove the tokens of the rows it stores and loads). See engine_context.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from vllm_kvcodec.offload_tier.engine_context import EngineContext, building

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVCodecOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole", kv_cache_config: "KVCacheConfig") -> None:
        self.engine_context = EngineContext(vllm_config)
        with building(self.engine_context):
            super().__init__(vllm_config, role, kv_cache_config)

    def on_new_request(self, request: "Request") -> None:
        with self.engine_context.announcing(request):
            super().on_new_request(request)


__all__ = ["KVCodecOffloadingConnector"]
