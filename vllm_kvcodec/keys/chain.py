"""Chunk keys: a hash chain over token ids inside a namespace.

The namespace digests everything that makes two chunks' bytes incomparable:
model identity (weights fingerprint, or a hub model's commit), dtype (``fp8_e4m3`` /
``fp8_e5m2`` for fp8 caches, with a digest of their per-layer scales, and the
compute dtype where the cache holds another), KV geometry, the content layout,
the compute identity (platform, kernels, versions; see keys/identity.py),
tensor-parallel size, chunking, layer grouping, the token digests' unit where it
is not 16, and format version, the
model-config inputs that change KV for the same weights (``hf_overrides`` and
the like, see keys/identity.py), the key hash itself, plus an optional deployment
salt, whether every rank holds the same KV (``kv_replicated``), and a lossy precision
where objects hold quantised KV (``precision``). A chunk's key covers the whole prefix up to it
(``h_i = H(h_{i-1} || tokens_i || media_i)``, seeded by the request's salt and
LoRA adapter), so equal keys mean equal prefixes in equal contexts. ``H`` is SHA-256
unless the deployment opted into XXH3-128 (:mod:`~vllm_kvcodec.keys.key_hash`), over explicit little-endian bytes:
stable across processes, machines and Python versions (no ``hash()``, no pickle).
The tensor-parallel rank and the layer group are path parts of the object key;
a replicated cache (MLA's latent under tensor parallelism: every rank holds the
whole latent) has one object per layer group, ``all`` in place of the rank.
Under pipeline parallelism (``pp_layers``) layer groups never straddle a stage
and are numbered across stages, so each stage writes and reads its own groups
under keys no other stage uses, and a lookup asks for every stage's groups.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np

from vllm_kvcodec.keys import key_hash
from vllm_kvcodec.format import VERSION as FORMAT_VERSION
from vllm_kvcodec.keys.identity import PLAIN, PromptIdentity

KEY_PREFIX = "kvc"


@dataclasses.dataclass(frozen=True)
class Namespace:
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_id: str
    tp_size: int
    chunk_size: int
    layers_per_object: int
    salt: str = ""
    compute: str = ""  # identity.compute_identity, or "" where chunks are shared across platforms
    format_version: int = FORMAT_VERSION
    # The key chain's hash (keys/key_hash.py): objects saved under one algorithm are never found under another.
    hash_algo: str = key_hash.SHA256
    # Objects are key-bound chunks (format flag KEY_BOUND) and readers require it; part of the
    # digest so that unbound objects written before this rule are never found, never re-read.
    key_bound: bool = True
    # Added after the first release; in the digest only when set, so every namespace that does
    # not need them keeps the digest (and the stored chunks) it had.
    kv_scales: str = ""  # fp8 caches: digest of the per-layer (k_scale, v_scale), see connector/cache_identity.py
    attention: str = ""  # each layer's attention kind ("window:W", "full") unless all are plain full attention
    # Every tensor-parallel rank holds the same KV (MLA's latent with TP > 1): one object per layer group, saved by
    # one rank and loaded by all (see object_key). In the digest: a deployment that stored one object per rank
    # before this rule never finds half of a chunk under the other scheme.
    kv_replicated: bool = False
    # Pipeline parallelism: each stage's layer count, in stage order ("15,15"); "" for one stage. In the digest
    # only when set: stages change the layer groups, and one stage's objects are no other stage's.
    pp_layers: str = ""
    # Model-config inputs that change the computed KV for the same weights and tokens (hf_overrides, model_impl,
    # ...: identity.config_inputs), as a digest; "" where all are at their defaults.
    config_inputs: str = ""
    # The model's compute dtype where the cache holds another (an fp8 cache, an explicit --kv-cache-dtype): K and V
    # computed in float32 and in bfloat16 round to other cache bytes. "" where ``dtype`` already names it (the
    # cache holds the model's dtype), so those namespaces keep their digests.
    compute_dtype: str = ""
    # Tokens per token digest where it is not token_digests.UNIT (blocks, or vLLM's prefix_match_unit, under 16
    # tokens): objects record their digests in it, and a reader of another unit fails every load (kind tokens).
    digest_unit: int = 0
    # A lossy precision (codecs/precision.py, ``Precision.key``: the level and what it keeps exact); "" for lossless,
    # so that every lossless namespace keeps its digest. A lossless reader never computes a lossy namespace's keys.
    precision: str = ""

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of every field (whatever the chain's hash: computed once per engine)."""
        fields = dataclasses.asdict(self)
        for name in _OPTIONAL_FIELDS:
            if not fields[name]:
                del fields[name]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @functools.cached_property
    def hash(self) -> Callable[[bytes], bytes]:
        """The chain's digest function."""
        return key_hash.digest_function(self.hash_algo)

    def stages(self) -> list[range]:
        """The layers of each pipeline stage, in order (one stage of every layer without pipeline parallelism)."""
        if not self.pp_layers:
            return [range(self.num_layers)]
        out, start = [], 0
        for count in (int(c) for c in self.pp_layers.split(",")):
            out.append(range(start, start + count))
            start += count
        if start != self.num_layers:
            raise ValueError(f"pipeline stages of {self.pp_layers} layers do not make {self.num_layers}")
        return out

    def layer_groups(self) -> list[range]:
        """The layers each stored object holds, in order: ``layers_per_object`` at a time, within each stage."""
        per = self.layers_per_object
        return [range(i, min(i + per, s.stop)) for s in self.stages() for i in range(s.start, s.stop, per)]

    def stage_groups(self, stage: int) -> tuple[int, list[range]]:
        """One stage's layer groups: the global number of its first group, and each group's layers counted from
        the stage's first layer (the positions of the KV caches that stage's worker holds)."""
        first = self.stages()[stage].start
        groups = self.layer_groups()
        mine = [i for i, g in enumerate(groups) if g.start in self.stages()[stage]]
        return mine[0], [range(groups[i].start - first, groups[i].stop - first) for i in mine]


_OPTIONAL_FIELDS = ("kv_scales", "attention", "kv_replicated", "pp_layers", "config_inputs", "compute_dtype", "digest_unit",
                    "precision")


def chunk_hashes(
    namespace: Namespace, token_ids: Sequence[int], num_chunks: int, identity: PromptIdentity = PLAIN
) -> list[str]:
    """Hex keys of the first ``num_chunks`` full chunks of ``token_ids`` in the request's context."""
    return extend_chunk_hashes(namespace, token_ids, [], num_chunks, identity)


def extend_chunk_hashes(
    namespace: Namespace, token_ids: Sequence[int], hashes: list[str], num_chunks: int,
    identity: PromptIdentity = PLAIN,
) -> list[str]:
    """``hashes`` (the chain's first chunks) continued to ``num_chunks`` chunks of ``token_ids``.

    A request's token list grows while it decodes; continuing the chain from
    its last link costs one hash per new chunk instead of rehashing the prefix.
    """
    size = namespace.chunk_size
    if num_chunks * size > len(token_ids):
        raise ValueError(f"{num_chunks} chunks of {size} need {num_chunks * size} tokens, got {len(token_ids)}")
    out = list(hashes[:num_chunks])
    if len(out) == num_chunks:
        return out
    prev = chain_link(namespace, out, identity)
    start = len(out)
    tokens = np.asarray(token_ids[start * size : num_chunks * size], dtype="<i8")
    for c in range(start, num_chunks):
        media = identity.media_in(c * size, (c + 1) * size)
        part = tokens[(c - start) * size : (c - start + 1) * size]
        prev = namespace.hash(prev + part.tobytes() + media)
        out.append(prev.hex())
    return out


def chain_link(namespace: Namespace, hashes: Sequence[str], identity: PromptIdentity) -> bytes:
    """The chain's value after ``hashes``: the last link, or the seed (namespace, salt, LoRA) before the first."""
    if hashes:
        return bytes.fromhex(hashes[-1])
    prev = namespace.hash(bytes.fromhex(namespace.digest))
    if seed := identity.seed():
        prev = namespace.hash(prev + seed)
    return prev


#: Domain tag of a prompt tail's link: a tail never has a full chunk's key, whatever its tokens.
_TAIL = b"kvc-tail"


def tail_hash(
    namespace: Namespace, token_ids: Sequence[int], hashes: Sequence[str], tokens: int,
    identity: PromptIdentity = PLAIN,
) -> str:
    """Key of a prompt's tail: its first ``tokens`` tokens after the full chunks ``hashes`` (fewer than a chunk).

    It hangs off the chain like the next chunk would, so it means the same
    prefix in the same context; it is a leaf (no chunk follows it), and a
    tail of another length is another key.
    """
    size = namespace.chunk_size
    if not 0 < tokens < size:
        raise ValueError(f"a prompt tail holds 1 to {size - 1} tokens, not {tokens}")
    start = len(hashes) * size
    if start + tokens > len(token_ids):
        raise ValueError(f"a tail of {tokens} tokens from {start} needs {start + tokens} tokens, got {len(token_ids)}")
    part = np.asarray(token_ids[start : start + tokens], dtype="<i8")
    media = identity.media_in(start, start + tokens)
    return namespace.hash(chain_link(namespace, hashes, identity) + _TAIL + part.tobytes() + media).hex()


def tail_position(namespace: Namespace, hashes: Sequence[str], identity: PromptIdentity = PLAIN) -> str:
    """A name for "some tail after the full chunks ``hashes``", whatever its length: what in-flight tail loads are
    tracked under, so a request whose local hit reaches into that chunk waits for any of them."""
    return "tail@" + chain_link(namespace, hashes, identity).hex()


def object_key(namespace: Namespace, chunk_hash: str, tp_rank: int, group: int) -> str:
    """Store key of one layer group of one rank's shard of one chunk.

    ``kvc/<namespace>/<chunk>/r<rank>g<group>``: the chain is shared by all
    tensor-parallel ranks (same tokens), the shard and layer group are not.
    A replicated cache's object is every rank's: ``kvc/<namespace>/<chunk>/allg<group>``.
    """
    shard = "all" if namespace.kv_replicated else f"r{tp_rank}"
    return f"{KEY_PREFIX}/{namespace.digest[:16]}/{chunk_hash}/{shard}g{group:03d}"


def stored_ranks(namespace: Namespace, tp_size: int) -> range:
    """The ranks whose objects a chunk is made of: each rank's shard, or one object for all (replicated)."""
    return range(1) if namespace.kv_replicated else range(tp_size)


def chunk_object_keys(namespace: Namespace, chunk_hash: str, tp_size: int, num_groups: int) -> list[str]:
    """Every object of one chunk: each tensor-parallel rank's shard of each layer group (what a lookup must find),
    so a chunk one rank lacks is a miss for all of them: no rank loads what another must recompute."""
    return [object_key(namespace, chunk_hash, r, g) for r in stored_ranks(namespace, tp_size) for g in range(num_groups)]


@dataclasses.dataclass(frozen=True)
class ObjectAddresses:
    """Where one rank's layer-group objects live: what the fetcher and the saver share."""

    namespace: Namespace
    tp_rank: int
    groups: tuple[range, ...]
    #: Pipeline parallelism: this stage's first layer group (``groups`` are numbered from 0 within the stage).
    first_group: int = 0

    def key(self, chunk_hash: str, group: int) -> str:
        """The key of this rank's object of ``group`` (counted within this stage) of a chunk."""
        return object_key(self.namespace, chunk_hash, self.tp_rank, self.first_group + group)

    @property
    def writes_refs(self) -> bool:
        """Block refs name a whole chunk (every rank's, every stage's objects): one writer per deployment, the
        first stage's rank 0."""
        return self.tp_rank == 0 and self.first_group == 0

    @property
    def saves(self) -> bool:
        """Whether this rank writes its objects: always, but for a replicated cache only rank 0 does (one writer
        per key; every deployment has a rank 0; the other ranks hold the same bits and only load)."""
        return not self.namespace.kv_replicated or self.tp_rank == 0
