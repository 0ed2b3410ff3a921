"""vllm-kvcodec: lossless compressed remote prefix KV cache for vLLM.

The connector class is ``vllm_kvcodec.connector.KVCodecConnector`` (imported
lazily here, so the codecs and the chunk format work without vLLM installed).
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "KVCodecConnector":
        from vllm_kvcodec.connector import KVCodecConnector

        return KVCodecConnector
    raise AttributeError(name)
