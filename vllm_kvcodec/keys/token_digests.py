"""What an object proves about its tokens: a chained digest per few tokens of the prompt it was computed from.

A key names an object; it does not prove what the object holds. A value
returned for the wrong key (a misrouted reply, a store bug, an operator's
copy, a writer that keyed a request wrongly) is intact, so no checksum
catches it, and a block ref, which names another object by its hash, only
moves the question. So every object records, in its header
(:class:`~vllm_kvcodec.format.TokenDigests`), one digest per ``unit`` tokens
of the token ids it was computed from, chained from the object's place in
the key chain: digest ``i`` covers the namespace, the request's context
(salt, LoRA adapter, media), every token before the object and its first
``(i + 1) * unit`` tokens. A load compares the first digests of the object
with those of its own prompt, for every token it will write, before a byte
reaches paged memory; a mismatch fails the load (recomputed, counted, the
object reported damaged), never wrong KV.

Per block, not one digest per object, because a load may take only the first
blocks of an object (a hit that ends inside it, through a block ref), and
the object must prove exactly those. Digests are 16 bytes of the key chain's
hash (SHA-256 by default): not a second line against a writer who forges
objects (the store's ACL decides who writes, see docs/reliability.md), but
enough that no accident makes another prompt's KV pass for this one's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import TOKEN_DIGEST_BYTES, TokenDigests
from vllm_kvcodec.keys.identity import PLAIN, PromptIdentity
from vllm_kvcodec.keys.chain import Namespace, chain_link

#: Tokens per digest, at most: a hit ends on a block boundary and vLLM's blocks are multiples of 16 where it
#: runs on GPUs; a smaller block (or alignment) takes its own size (:func:`digest_unit`).
UNIT = 16
#: Domain tag: a digest chain never equals a key of the chain it hangs off.
_TAG = b"kvc-tokens"


class TokenMismatchError(ChunkFormatError):
    """An intact object that does not hold the KV of the prompt that asked for it."""


def digest_unit(alignment: int, chunk_size: int) -> int:
    """Tokens per digest for hits that end on multiples of ``alignment`` inside chunks of ``chunk_size``."""
    return math.gcd(UNIT, alignment, chunk_size)


def token_digests(namespace: Namespace, token_ids: Sequence[int], hashes: Sequence[str], tokens: int, unit: int,
                  identity: PromptIdentity = PLAIN) -> TokenDigests:
    """The digests of an object of ``tokens`` tokens (a multiple of ``unit``) after the full chunks ``hashes``."""
    start = len(hashes) * namespace.chunk_size
    if tokens <= 0 or tokens % unit or start + tokens > len(token_ids):
        raise ValueError(f"{tokens} tokens from {start} are not whole digests of {unit} within {len(token_ids)} tokens")
    ids = np.asarray(token_ids[start : start + tokens], dtype="<i8").tobytes()
    step = unit * 8
    prev = namespace.hash(chain_link(namespace, hashes, identity) + _TAG)
    out = []
    for i in range(tokens // unit):
        a = start + i * unit
        media = identity.media_in(a, a + unit) if identity.media else b""
        prev = namespace.hash(prev + ids[i * step : (i + 1) * step] + media)
        out.append(prev[:TOKEN_DIGEST_BYTES])
    return TokenDigests(unit, b"".join(out))


def check_tokens(stored: TokenDigests | None, expected: TokenDigests, key: str) -> None:
    """Raise unless the object under ``key`` records the tokens ``expected`` covers (the first ones it holds)."""
    if stored is None:
        raise TokenMismatchError(f"object {key} records no token digests; a reader that checks tokens needs them")
    if stored.unit != expected.unit or not stored.digests.startswith(expected.digests):
        raise TokenMismatchError(f"object {key} holds the KV of other tokens than this prompt's "
                                 f"(its first {expected.count * expected.unit} tokens' digests differ)")
