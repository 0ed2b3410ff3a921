"""A load plan: which stored chunks go into which slots of vLLM's paged memory, for one request.

Made by the scheduler half (``connector/scheduler_half.py``), carried to the
workers in the step's ``KVCodecMetadata``, run by the fetcher (``load/``).
"""

from __future__ import annotations

import dataclasses

from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.format import TokenDigests
from vllm_kvcodec.plans.spans import Span, one_span


@dataclasses.dataclass
class ChunkLoad:
    """One stored chunk to bring into paged memory.

    ``spans`` has one :class:`~vllm_kvcodec.plans.spans.Span` per vLLM KV cache
    group: the chunk's tokens from the span's ``first_token`` on, at their
    slots in that group's blocks. Tokens before it are already in vLLM's local
    prefix cache, in blocks other requests may share, and are never written; a
    sliding-window group's span also leaves out the tokens whose blocks vLLM
    did not allocate (outside the window of the hit). ``block_ids`` are every
    block the load writes, of all groups. A prompt tail (``prompt_tails``) is
    an object of fewer tokens than a chunk, as ``object_tokens`` says; a
    load through a block ref (:mod:`~vllm_kvcodec.keys.block_refs`) writes only the
    first of the object's tokens. ``expect``: the digests of this prompt's tokens the object must record
    (:mod:`~vllm_kvcodec.keys.token_digests`), up to the last token the load writes; checked before any write.
    ``precisions``: the namespaces to read it from, in order (``lossless``, or a lossy level: see
    ``connector/precisions.py``); a later one is read where an earlier one is missing or fails (precision auto:
    the lossy variant, then the lossless object the lookup found).
    """

    chunk_hash: str
    spans: list[Span]
    block_ids: list[int]
    object_tokens: int | None = None  # tokens the stored object holds: None for a full chunk, fewer for a tail
    expect: TokenDigests | None = None
    precisions: tuple[str, ...] = (LOSSLESS,)

    @property
    def tokens(self) -> int:
        """Tokens loaded: the longest span (the full-attention groups')."""
        return max((len(s.slots) for s in self.spans), default=0)

    @property
    def first_token(self) -> int:
        return one_span(self.spans).first_token

    @property
    def slots(self) -> list[int]:
        return one_span(self.spans).slots


@dataclasses.dataclass
class LoadSpec:
    """One request's load. ``load_id``: the scheduler half's id of this load, which the worker echoes in its
    :class:`LoadOutcome` (request ids can be reused, see :mod:`~vllm_kvcodec.connector.load_ledger`)."""

    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool
    load_id: int = 0
    adapter: tuple[int, str] | None = None  # LoRA: (adapter id, weights its keys name), which the worker checks


@dataclasses.dataclass
class PrefetchSpec:
    """The chunks (full ones, and a prompt tail) a lookup found for a request that waits: fetch them ahead."""

    req_id: str
    chunk_hashes: list[str]
    precisions: list[tuple[str, ...]] | None = None  # per chunk, as ChunkLoad.precisions (None: lossless each)
