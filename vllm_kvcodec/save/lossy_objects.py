"""A lossy precision's objects (LOSSY: NOT BIT-EXACT): a gathered chunk as canonical KV, quantised per layer group.

The quantiser reads keys per channel and values per token (KIVI's split), so
it needs K and V apart: a gathered chunk in the engine's object layout (its
pages, by default) is read as canonical ``[layers, 2, tokens, heads, dim]``
KV first, whatever the lossless objects beside it hold. Each layer group's
object keeps exact the part of the model's first ``full_layers`` layers it
holds, and a sequence's first chunk its first ``sink_tokens`` tokens
(:meth:`~vllm_kvcodec.codecs.precision.Precision.within`).

A chunk holding NaN or inf has no quantisation step (the codec refuses it,
``NonFiniteKVError``): it is stored lossless only. Under ``precision: auto``
the lossless object beside it is that; on a lossy-only engine it is a
lossless object in the lossy namespace, which a lossy reader decodes like
any other (a lossless reader never looks there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from vllm_kvcodec.codecs import Codec, policy
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.codecs.precision import Precision
from vllm_kvcodec.codecs.quantized import NonFiniteKVError
from vllm_kvcodec.format import TokenDigests, encode_chunk
from vllm_kvcodec.keys.chain import ObjectAddresses
from vllm_kvcodec.stats import ConnectorStats


@dataclasses.dataclass
class LossyObjects:
    """How one worker stores a lossy level's objects: where (``addresses``, by level name), from what
    (``to_canonical``: a gathered chunk as canonical KV), each layer group's first model layer, and the lossless
    codec of a chunk no step represents (``exact``: the configured one; None: the default for its dtype)."""

    level: Precision
    addresses: dict[str, ObjectAddresses]
    to_canonical: Callable[[torch.Tensor], torch.Tensor]
    first_layers: Sequence[int]
    stats: ConnectorStats
    exact: Codec | None = None

    def encode(self, kv: torch.Tensor, keys: Sequence[str], digests: TokenDigests | None, first_chunk: bool,
               lossless_beside: bool) -> tuple[list[tuple[str, bytes]], list[Codec]]:
        """Each layer group's object under its key, and the codecs that stored them; none for a chunk holding NaN
        or inf that is stored lossless beside (``lossless_beside``), else that chunk lossless under these keys."""
        canonical = self.to_canonical(kv)
        groups = self.addresses[self.level.name].groups
        tokens = canonical.shape[2]
        levels = [self.level.within(first, len(layers), tokens, first_chunk)
                  for first, layers in zip(self.first_layers, groups)]
        try:
            items = [(key, encode_chunk(canonical[layers.start : layers.stop], key=key, tokens=digests,
                                        precision=level)) for key, layers, level in zip(keys, groups, levels)]
            return items, [policy.precision_codec(level) for level in levels]  # type: ignore[misc] - lossy: a codec
        except NonFiniteKVError:
            self.stats.add(precision_nonfinite_chunks=1)
        if lossless_beside:
            return [], []
        codec = self.exact or policy.codec_for(None, DType.from_torch(canonical.dtype), unsupported="error")[0]
        return [(key, encode_chunk(canonical[layers.start : layers.stop], codec, key=key, tokens=digests))
                for key, layers in zip(keys, groups)], [codec]
