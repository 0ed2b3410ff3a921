"""One codec policy for the connector, its config, the chunk format and the LMCache plug-in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.codecs.policy import (
    FALLBACK_CODEC, LossyCodecError, check_spec, codec_for, default_codec_for, lossless_codec,
)
from vllm_kvcodec.codecs.raw import RawCodec
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ConfigError, UnsupportedDTypeError
from vllm_kvcodec.format import encode_chunk


class _Truncating(RawCodec):
    """A lossy codec for the test: keeps the high byte of each value."""

    codec_id = "test-truncating"
    lossless = False

    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        return (bits & 0xFF00).tobytes()


def test_defaults_follow_the_dtype() -> None:
    assert default_codec_for(DType.BFLOAT16) == "rans" and default_codec_for(DType.FLOAT32) == "rans"
    assert default_codec_for(DType.FLOAT16) == FALLBACK_CODEC == "zstd"
    assert codec_for(None, DType.FLOAT16, "error")[0].codec_id == "zstd"


def test_a_named_codec_that_cannot_hold_the_dtype_fails_or_falls_back() -> None:
    with pytest.raises(UnsupportedDTypeError):
        codec_for("splitzip", DType.FLOAT16, "error")  # the connector: at start-up
    codec, fell_back = codec_for("splitzip", DType.FLOAT16, "fallback")  # the LMCache plug-in
    assert fell_back and codec.codec_id == FALLBACK_CODEC
    assert codec_for("splitzip", DType.BFLOAT16, "error") == (get_codec("splitzip"), False)


def test_lossy_codecs_are_refused_everywhere() -> None:
    lossy = _Truncating()
    with pytest.raises(LossyCodecError, match="lossy"):
        lossless_codec(lossy)
    with pytest.raises(LossyCodecError):
        encode_chunk(torch.zeros(4, dtype=torch.bfloat16), lossy)
    with pytest.raises(ConfigError, match="unknown codec 'lzma'"):
        check_spec("lzma", allow_auto=True)
    assert check_spec("auto", allow_auto=True) == "auto"
    with pytest.raises(ConfigError, match="auto"):
        check_spec("auto", allow_auto=False)
