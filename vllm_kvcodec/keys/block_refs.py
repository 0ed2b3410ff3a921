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
Refs are tiny (about 150 bytes), written once, after the object landed, by
one rank; any object whose first ``j`` blocks are those tokens is a right
answer, so concurrent writers never conflict. A ref whose object is gone is
a miss (the lookup checks the object), never a load of missing KV; if the
tail stored under the ref's own prefix is still there, that tail is loaded.

A ref is bound to its key: its value names the prefix it is stored under
(and that prefix's length), so a value returned for another key is no ref.
What it leads to is checked again where it matters, at the load: the object
must record the prompt's own tokens (:mod:`~vllm_kvcodec.keys.token_digests`).

A tail object's own length gets a ref too (pointing at itself), so one read
of refs answers every candidate; a full chunk is found by its chunk hash.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from vllm_kvcodec.keys.identity import PLAIN, PromptIdentity
from vllm_kvcodec.keys.chain import KEY_PREFIX, Namespace, tail_hash

_MAGIC = b"kvcref2 "
_HASH = re.compile(rb"[0-9a-f]{32}|[0-9a-f]{64}")  # an XXH3-128 or a SHA-256 key (keys/key_hash.py)
_MAX_REF_BYTES = 192


@dataclasses.dataclass(frozen=True)
class Ref:
    """What a ref names: the object ``chunk_hash`` holding ``object_tokens`` tokens from the same chain position;
    the ref itself stands for the first ``prefix_tokens`` of them (0: not known, a ref being written)."""

    chunk_hash: str
    object_tokens: int
    prefix_tokens: int = 0


def ref_key(namespace: Namespace, prefix_hash: str) -> str:
    """Store key of the ref for the block prefix ``prefix_hash`` (namespace-wide: one for all ranks and groups)."""
    return f"{KEY_PREFIX}/{namespace.digest[:16]}/{prefix_hash}/ref"


def is_ref_key(key: str) -> bool:
    """Whether a store key is a block ref (not a chunk object: tools that read headers skip it)."""
    return key.startswith(f"{KEY_PREFIX}/") and key.endswith("/ref")


def encode_ref(prefix_hash: str, prefix_tokens: int, ref: Ref) -> bytes:
    """The value of the ref stored under ``prefix_hash`` (the first ``prefix_tokens`` of ``ref``'s object)."""
    return b" ".join((_MAGIC.rstrip(), prefix_hash.encode(), str(prefix_tokens).encode(), ref.chunk_hash.encode(),
                      str(ref.object_tokens).encode()))


def parse_ref(blob: bytes | None, prefix_hash: str, chunk_size: int) -> Ref | None:
    """The ref in ``blob`` read from under ``prefix_hash``, or None when it is absent, malformed or bound to
    another key.

    Untrusted bytes: anything but the exact format (the key's own prefix hash,
    a token count for it, a hex hash, and an object's token count between the
    prefix's and a chunk's) is no ref at all.
    """
    if blob is None or len(blob) > _MAX_REF_BYTES or not blob.startswith(_MAGIC):
        return None
    parts = blob[len(_MAGIC):].split(b" ")
    if len(parts) != 4 or parts[0] != prefix_hash.encode() or not _HASH.fullmatch(parts[2]):
        return None
    if not all(p.isdigit() and len(p) <= 6 for p in (parts[1], parts[3])):
        return None
    prefix_tokens, tokens = int(parts[1]), int(parts[3])
    if not 0 < prefix_tokens <= tokens <= chunk_size:
        return None
    return Ref(parts[2].decode(), tokens, prefix_tokens)


def prefix_hashes(namespace: Namespace, token_ids: Sequence[int], hashes: Sequence[str], object_tokens: int,
                  align: int, identity: PromptIdentity = PLAIN) -> list[tuple[str, int]]:
    """The refs an object of ``object_tokens`` tokens after the full chunks ``hashes`` gets, as (prefix hash,
    prefix tokens): one per whole ``align``-token prefix, up to but not including a full chunk (found by its chunk
    hash), so a tail's own length is included."""
    last = min(object_tokens, namespace.chunk_size - 1)
    return [(tail_hash(namespace, token_ids, hashes, t, identity), t) for t in range(align, last + 1, align)]
