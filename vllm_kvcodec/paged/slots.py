"""Slot mappings: which paged-memory slot holds which token of a request.

vLLM addresses a token of a request by ``slot = block_ids[pos // block_size] *
block_size + pos % block_size``, where ``block_ids`` is the request's block
table for its KV cache group (``NewRequestData.block_ids[group]`` in the
scheduler output, extended by ``CachedRequestData.new_block_ids``) and
``block_size`` is ``vllm_config.cache_config.block_size``. The attention
metadata of a step carries the same numbers for the tokens computed in that
step (``attn_metadata.slot_mapping``, int64, one per scheduled token, all
requests of the batch concatenated in ``query_start_loc`` order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvcodec.paged.base import SlotError


def slots_for_tokens(
    block_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    start: int = 0,
    stop: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Slots (int64) of token positions ``[start, stop)`` of a request with block table ``block_ids``.

    ``stop`` defaults to the end of the last block. Raises :class:`SlotError`
    if the range runs past the blocks.
    """
    blocks = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    if blocks.dim() != 1:
        raise SlotError(f"block_ids must be 1-D, got shape {tuple(blocks.shape)}")
    if block_size <= 0:
        raise SlotError(f"block_size must be positive, got {block_size}")
    capacity = blocks.numel() * block_size
    stop = capacity if stop is None else stop
    if not 0 <= start <= stop <= capacity:
        raise SlotError(f"token range [{start}, {stop}) does not fit {blocks.numel()} blocks of {block_size}")
    pos = torch.arange(start, stop, dtype=torch.int64, device=blocks.device)
    return blocks[pos // block_size] * block_size + pos % block_size

