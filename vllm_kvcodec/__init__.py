"""vllm-kvcodec: lossless compressed remote prefix KV cache for vLLM.

The connector class is ``vllm_kvcodec.connector.KVCodecConnector`` (imported
lazily here, so the codecs and the chunk format work without vLLM installed).
Its stores are the top-level package ``storage``; importing this package checks
that ``storage`` is that one (:mod:`vllm_kvcodec.runtime.storage_package`).
"""

from typing import Any

from vllm_kvcodec.runtime.storage_package import check_storage_package

__version__ = "0.1.0"

check_storage_package()  # a 'storage' package of another distribution shadowing ours is refused here, by path


def __getattr__(name: str) -> Any:
    if name == "KVCodecConnector":
        from vllm_kvcodec.connector import KVCodecConnector

        return KVCodecConnector
    raise AttributeError(name)
