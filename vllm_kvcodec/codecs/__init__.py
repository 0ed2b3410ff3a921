"""Codecs behind one interface (see :mod:`.base`); importing this package registers them all."""

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.registry import codec_ids, get_codec, register_codec
from vllm_kvcodec.codecs import raw as _raw  # noqa: F401  (registers)
from vllm_kvcodec.codecs import splitzip as _splitzip  # noqa: F401
from vllm_kvcodec.codecs import video as _video  # noqa: F401
from vllm_kvcodec.codecs import rans as _rans  # noqa: F401
from vllm_kvcodec.codecs import zstd as _zstd  # noqa: F401
from vllm_kvcodec.codecs import quantized as _quantized  # noqa: F401  (lossy: only a precision level names it)

__all__ = ["Codec", "codec_ids", "get_codec", "register_codec"]
