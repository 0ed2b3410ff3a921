"""Which slots of which KV cache group a chunk's tokens occupy: the per-group part of load and save plans.

vLLM's hybrid KV cache manager (HMA) gives each *KV cache group* (layers of one
attention kind: full attention, one sliding window, ...) its own block table.
A stored chunk holds every layer, so a plan says, per group, where the chunk's
tokens live in that group's blocks. A sliding-window group holds only the
blocks its window still needs (vLLM puts its null block, id 0, in the others),
so its span of a load can be shorter than the chunk, or empty; a save's spans
always cover the whole chunk. Plain data without vLLM (the load path runs
without it on a GPU check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class Span:
    """Tokens ``first_token:first_token + len(slots)`` of a chunk (offsets in the chunk), at ``slots`` of one group."""

    first_token: int
    slots: list[int]


def one_span(spans: Sequence[Span]) -> Span:
    """The span of a plan for a model with one KV cache group (what single-group code and tests read)."""
    if len(spans) != 1:
        raise ValueError(f"this plan has {len(spans)} KV cache groups, one span each: read .spans")
    return spans[0]


def one_group(group_slots: Sequence[list[int]]) -> list[int]:
    """A save's slots for a model with one KV cache group."""
    if len(group_slots) != 1:
        raise ValueError(f"this save has {len(group_slots)} KV cache groups, slots for each: read .group_slots")
    return group_slots[0]
