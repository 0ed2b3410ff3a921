"""The stored bytes: the chunk container (:mod:`.container`) and its decoding on a CUDA device (:mod:`.device_chunks`).

``vllm_kvcodec.format.encode_chunk`` / ``decode_chunk`` are the public chunk
API (docs/format.md, the notebooks): the container's names are re-exported
here. The container picks and calls codecs (:mod:`vllm_kvcodec.codecs`); it
never chooses among them: that is the save path's (:mod:`vllm_kvcodec.save.codec_choice`).
"""

from vllm_kvcodec.format.container import *  # noqa: F401,F403
from vllm_kvcodec.format.container import __all__  # noqa: F401
