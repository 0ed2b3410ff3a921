"""A save plan: one computed chunk to gather out of paged memory and store, with what its object records.

Made by the scheduler half, carried to the workers in the step's
``KVCodecMetadata``, gathered and stored by ``save/``.
"""

from __future__ import annotations

import dataclasses

from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.format import TokenDigests
from vllm_kvcodec.plans.spans import one_group


@dataclasses.dataclass
class SaveSpec:
    """One full chunk computed by this step (or earlier), to gather and store.

    ``unsettled_loads`` are the ids of the request's loads whose outcome the
    scheduler half had not heard of (from every worker) when it planned the
    save: the chunk may have been computed over KV that never arrived, on
    this worker or any other (their outputs are all-reduced, or feed the next
    stage). A worker on which one of them failed drops the save at once;
    where other workers run the same loads, the others hold it until the
    scheduler half sends the load's verdict (``KVCodecMetadata.settled_loads``,
    :mod:`~vllm_kvcodec.save.held_saves`). Ids, not a count of failures: a
    rank whose load failed a step after another rank's succeeded is judged by
    the same load, and a new request under a finished one's id never inherits
    its failures.
    """

    req_id: str
    chunk_hash: str
    group_slots: list[list[int]]  # the chunk's slots in each KV cache group's blocks
    unsettled_loads: list[int] = dataclasses.field(default_factory=list)
    # its whole-block prefixes (hash, tokens), whose refs rank 0 writes (block_refs.py)
    refs: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    digests: TokenDigests | None = None  # its tokens, recorded in every object's header (token_digests.py)
    adapter: tuple[int, str] | None = None  # LoRA: (adapter id, weights its key names), which the worker checks
    # the namespaces to store it in (lossless, a lossy level, or both with precision auto: connector/precisions.py),
    # and whether it is its sequence's first chunk (which alone keeps a lossy level's sink tokens exact)
    precisions: tuple[str, ...] = (LOSSLESS,)
    first_chunk: bool = False

    @property
    def slots(self) -> list[int]:
        return one_group(self.group_slots)

    @property
    def tokens(self) -> int:
        return len(self.group_slots[0])
