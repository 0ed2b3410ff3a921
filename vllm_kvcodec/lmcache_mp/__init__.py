"""vllm-kvcodec for LMCache's multiprocess (MP) mode: lossless serdes and an L2 adapter over our stores.

Importing this package registers the serdes ``kvcodec-rans``, ``kvcodec-splitzip``,
``kvcodec-zstd``, ``kvcodec-raw`` and ``kvcodec-auto`` with LMCache
(:mod:`.registration`); LMCache imports it when an L2 adapter names it::

    {"type": "plugin", "module_path": "vllm_kvcodec.lmcache_mp", "class_name": "KVCodecL2Adapter",
     "adapter_params": {"store": "redis://host:6379/0"}, "serde": {"type": "kvcodec-zstd"}}

This package imports lmcache; ``import vllm_kvcodec`` never imports it. See docs/lmcache.md.
"""

from vllm_kvcodec.lmcache_mp.l2_adapter import KVCodecL2Adapter, KVCodecL2AdapterConfig
from vllm_kvcodec.lmcache_mp.registration import SERDES, register_serdes

register_serdes()

__all__ = ["SERDES", "KVCodecL2Adapter", "KVCodecL2AdapterConfig", "register_serdes"]
