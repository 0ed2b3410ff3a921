"""A CPU-tier row to a stored object and back: this project's chunk format and codecs, bit-exact.

A row is one offloaded chunk as vLLM's CPU tier holds it: ``row_bytes`` bytes
of the KV cache dtype (every layer's and every worker's pages, in vLLM's own
order, plus alignment padding). The codecs see it as a ``[elements / channels,
channels]`` array: elementwise codecs (splitzip) do not care, and a channel
count that divides the head size keeps per-channel models (rANS) aligned with
the head dimension, since vLLM's layouts keep ``head_size`` innermost. The
chunk format binds each object to its key, records the digests of the tokens
it was computed from (proofs.py) and checksums it; a load validates the header
(dtype, shape, key, tokens) against this tier's row and its own request's
tokens before writing a byte, so a damaged, foreign, misplaced or mis-keyed
object fails its block instead of corrupting the CPU tier.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ChunkFormatError, ConfigError
from vllm_kvcodec.format import TokenDigests, decode_payload, encode_chunk, read_header
from vllm_kvcodec.keys.token_digests import check_tokens


class RowCodec:
    """Encodes rows of ``row_bytes`` bytes of ``dtype`` with ``codec`` (None: the policy's default for the dtype)."""

    def __init__(self, dtype: DType, row_bytes: int, codec: str | None, channels: int) -> None:
        if row_bytes % dtype.itemsize:
            raise ConfigError(f"a CPU-tier row of {row_bytes} bytes is not a whole number of {dtype.name.lower()} values")
        elements = row_bytes // dtype.itemsize
        if channels < 1 or elements % channels:
            raise ConfigError(f"channels={channels} does not divide a row of {elements} values")
        self.dtype, self.row_bytes, self.codec = dtype, row_bytes, codec
        self.shape = (elements // channels, channels)

    def encode(self, row: memoryview, key: str, tokens: TokenDigests) -> bytes:
        """The row's bytes as a chunk bound to ``key``, recording ``tokens`` (the row is read, not kept)."""
        bits = np.frombuffer(row, dtype=self.dtype.bits_dtype).reshape(self.shape)
        tensor = torch.from_numpy(bits).view(self.dtype.torch_dtype)
        return encode_chunk(tensor, self.codec, key=key, tokens=tokens)

    def decode_into(self, blob: bytes, key: str, row: memoryview, tokens: TokenDigests) -> None:
        """Validate ``blob`` as this tier's row under ``key`` computed from ``tokens``, decode it, then write it
        into ``row``."""
        header = read_header(blob, key=key)
        if header.dtype != self.dtype or tuple(header.shape) != self.shape:
            raise ChunkFormatError(f"object under {key} holds {header.dtype.name.lower()} {tuple(header.shape)}, "
                                   f"this tier's rows are {self.dtype.name.lower()} {self.shape}")
        check_tokens(header.tokens, tokens, key)
        decoded = decode_payload(blob, header, borrow=True)
        source = decoded.contiguous().view(-1).view(torch.uint8).numpy()
        np.copyto(np.frombuffer(row, dtype=np.uint8), source)
