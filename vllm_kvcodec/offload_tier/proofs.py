"""What a row proves about its tokens: the connector's token digests, chained per vLLM block in the tier's namespace.

vLLM's offload key is its block hash, a chain over the prefix's token ids. It
vouches for the tokens only as far as vLLM's hash does: SHA-256 (vLLM's
default) is collision resistant, ``xxhash`` is not, and a store shared across
engines needs a PYTHONHASHSEED they share, so its seed is no secret and a
tenant who chooses prompts could craft one whose block hashes are another
prompt's. Nor does a key bind a row to it: a writer that keyed a request
wrongly stores intact KV under another prompt's key. So every row records the
connector's token digests (:mod:`~vllm_kvcodec.keys.token_digests`) of the tokens it
was computed from, one per vLLM block of the row, each chained from the
namespace, the request's context (``cache_salt``, the LoRA adapter with a
fingerprint of its files, media) and every token before it, with SHA-256
whatever vLLM hashes with; a load compares them with its own request's before
a byte reaches the CPU tier. A row whose tokens the tier cannot tell (a request
it was not told of, prompt embeddings, a key without a position) is neither
stored nor loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx

from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.format import MAX_TOKEN_DIGESTS, TokenDigests
from vllm_kvcodec.keys.identity import PromptIdentity, prompt_identity
from vllm_kvcodec.keys.chain import Namespace, extend_chunk_hashes
from vllm_kvcodec.keys.token_digests import token_digests

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.request import Request


class PromptChain:
    """One request's key chain in the tier's namespace (a link per vLLM block), extended as the request grows."""

    def __init__(self, namespace: Namespace, request: "Request", identity: PromptIdentity) -> None:
        self.namespace, self.request, self.identity = namespace, request, identity
        self._links: list[str] = []
        self._last: bytes | None = None  # vLLM's hash of the last block the links cover (it chains all before)

    def digests(self, start: int, end: int) -> TokenDigests:
        """What the row of tokens ``[start, end)`` (whole vLLM blocks) records of them."""
        unit = self.namespace.chunk_size
        return token_digests(self.namespace, self.request.all_token_ids, self._chain(start // unit), end - start,
                             unit, self.identity)

    def _chain(self, links: int) -> list[str]:
        blocks = self.request.block_hashes
        if self._links and blocks[len(self._links) - 1 : len(self._links)] != [self._last]:
            self._links = []  # a streaming session rewrote tokens the links cover: chain them anew
            self.identity = prompt_identity(self.request) or self.identity
        if len(self._links) < links:
            self._links = extend_chunk_hashes(self.namespace, self.request.all_token_ids, self._links, links,
                                              self.identity)
            self._last = blocks[links - 1]
        return self._links[:links]


class RowProofs:
    """The token digests of each row of each request the tier was told of (scheduler thread only)."""

    def __init__(self, namespace: Namespace, config: "OffloadingConfig") -> None:
        self.namespace = namespace
        #: Tokens a row holds, by KV cache group (the group is part of vLLM's offload key).
        self.row_tokens = {g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups}
        most = max(self.row_tokens.values(), default=0) // namespace.chunk_size
        if most > MAX_TOKEN_DIGESTS:
            raise ConfigError(f"rows of {most} blocks of {namespace.chunk_size} tokens need more token digests than "
                              f"an object holds ({MAX_TOKEN_DIGESTS}): lower blocks_per_chunk")
        self._prompts: dict[str, PromptChain] = {}

    def admit(self, req_id: str, request: "Request | None") -> None:
        """A new request (None: one the tier was not told of): its rows are proved from its tokens."""
        identity = prompt_identity(request) if request is not None else None
        if identity is not None:
            self._prompts[req_id] = PromptChain(self.namespace, request, identity)

    def knows(self, req_id: str) -> bool:
        return req_id in self._prompts

    def forget(self, req_id: str) -> None:
        self._prompts.pop(req_id, None)

    def of(self, key: OffloadKey, context: ReqContext) -> TokenDigests | None:
        """The digests of the row under ``key`` for this request, or None where its tokens cannot be told."""
        chain = self._prompts.get(context.req_id)
        end = context.get_offload_key_position(key)
        size = self.row_tokens.get(get_offload_group_idx(key))
        if chain is None or end is None or size is None or end <= 0:
            return None
        try:
            return chain.digests(end - 1 - (end - 1) % size, end)
        except ValueError:  # tokens the request does not hold (yet): unprovable, never a scheduler error
            return None
