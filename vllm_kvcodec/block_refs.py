"""Block refs: how a hit ends on the same block vLLM's own prefix cache would end on.

vLLM's prefix cache is block-granular: a prompt that shares 1400 tokens
with one computed before hits 1376 of them (block 32). Stored objects are
chunks (and a prompt's tail, fewer tokens than a chunk), addressed by a hash
of *all* their tokens, so a prompt that diverges inside a chunk cannot name
the object that holds the blocks it shares. Stopping the hit at the last
whole chunk instead is not only slower: bf16 prefill of the rest on top of
the loaded part does not round like the prefill that computed it, and at a
near-tie the greedy tokens differ from the local-cache run's.

So every stored object also gets a *ref* per whole-block prefix of its tokens
after its chain position (``tail_hash`` of the first ``j`` blocks: the key a
prompt sharing exactly those blocks computes), naming the object and how
many tokens it holds. A lookup reads the refs of its candidate prefixes
(longest first) and loads the first ``j`` blocks of the object a ref names.
Refs are tiny (about 45 bytes), written once, after the object landed, by
one rank; any object whose first ``j`` blocks are those tokens is a right
answer, so concurrent writers never conflict. A ref whose object is gone is
a miss (the lookup checks the object), never a load of missing KV.

A tail object's own length gets a ref too (pointing at itself), so one read
of refs answers every candidate; a full chunk is found by its chunk hash.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from vllm_kvcodec.identity import PLAIN, PromptIdentity
from vllm_kvcodec.keys import KEY_PREFIX, Namespace, tail_hash

_MAGIC = b"kvcref1 "
_HASH = re.compile(rb"[0-9a-f]{32}")


@dataclasses.dataclass(frozen=True)
class Ref:
    """What a ref names: the object ``chunk_hash`` holding ``object_tokens`` tokens from the same chain position."""

    chunk_hash: str
    object_tokens: int


def ref_key(namespace: Namespace, prefix_hash: str) -> str:
    """Store key of the ref for the block prefix ``prefix_hash`` (namespace-wide: one for all ranks and groups)."""
    return f"{KEY_PREFIX}/{namespace.digest[:16]}/{prefix_hash}/ref"


def is_ref_key(key: str) -> bool:
    """Whether a store key is a block ref (not a chunk object: tools that read headers skip it)."""
    return key.startswith(f"{KEY_PREFIX}/") and key.endswith("/ref")


def encode_ref(ref: Ref) -> bytes:
    return _MAGIC + ref.chunk_hash.encode() + b" " + str(ref.object_tokens).encode()


def parse_ref(blob: bytes | None, chunk_size: int, prefix_tokens: int) -> Ref | None:
    """The ref in ``blob``, or None when it is absent or is not a ref of at least ``prefix_tokens`` tokens.

    Untrusted bytes: anything but the exact format (a 128-bit hex hash and a
    token count between the prefix's and a chunk's) is no ref at all.
    """
    if blob is None or len(blob) > 64 or not blob.startswith(_MAGIC):
        return None
    parts = blob[len(_MAGIC):].split(b" ")
    if len(parts) != 2 or not _HASH.fullmatch(parts[0]) or not parts[1].isdigit() or len(parts[1]) > 6:
        return None
    tokens = int(parts[1])
    if not prefix_tokens <= tokens <= chunk_size:
        return None
    return Ref(parts[0].decode(), tokens)


def prefix_hashes(namespace: Namespace, token_ids: Sequence[int], hashes: Sequence[str], object_tokens: int,
                  align: int, identity: PromptIdentity = PLAIN) -> list[str]:
    """The refs an object of ``object_tokens`` tokens after the full chunks ``hashes`` gets: one per whole
    ``align``-token prefix, up to but not including a full chunk (found by its chunk hash), so a tail's own
    length is included."""
    last = min(object_tokens, namespace.chunk_size - 1)
    return [tail_hash(namespace, token_ids, hashes, t, identity) for t in range(align, last + 1, align)]
