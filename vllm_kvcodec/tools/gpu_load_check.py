"""A load end to end without vLLM: real KV chunks in a store -> a fetcher -> packed paged caches -> compare.

Shared by the interpreter tests (CPU tensors), the ``gpu``-marked tests and
the device check (``benchmarks/gpu_check.py``), so all three exercise the same
odd cases: request block tables in random, non-contiguous order, a chunk whose
first tokens are already cached (a partial first block), several codecs (the
bf16 ``splitzip`` decodes on the device, a lossy ``quantized`` object is
dequantised there, the others decode on the CPU), and the
physical stride orders vLLM 0.33 uses for the packed K‖V layout. The expected
caches come from :class:`~vllm_kvcodec.paged.PackedKVLayout` (torch indexing
on the CPU: what the CPU fetcher writes). Imports no vLLM. Counters are the
product's :class:`~vllm_kvcodec.stats.ConnectorStats` (no stand-in: a
stand-in that lacked ``sample()`` once killed the fetcher's pool task on the
device and left ``wait_layer`` to its deadline).
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import torch

from storage import open_store
from vllm_kvcodec.codecs.precision import LEVELS, LOSSLESS, Precision
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.paged import Geometry, PackedKVLayout
from vllm_kvcodec.plans.spans import Span

#: Physical orders of the 4-D logical view [blocks, heads, block_size, 2*head]:
#: vLLM 0.33's NHD default (LBNHC: tokens before heads) and HND (LBHNC).
ORDERS = ("NHD", "HND")


@dataclasses.dataclass
class Chunk:
    """Duck-types :class:`vllm_kvcodec.plans.loads.ChunkLoad`: one KV cache group."""

    chunk_hash: str
    first_token: int
    slots: list[int]
    block_ids: list[int]
    object_tokens: int | None = None  # always a full chunk here
    expect: None = None  # the objects here record no prompt's tokens (made for the check, not by the connector)
    precisions: tuple[str, ...] = (LOSSLESS,)  # read from the engine's own namespace only

    @property
    def spans(self) -> list[Span]:
        return [Span(self.first_token, self.slots)]

    @property
    def tokens(self) -> int:
        return len(self.slots)


@dataclasses.dataclass
class Spec:
    """Duck-types :class:`vllm_kvcodec.plans.loads.LoadSpec`."""

    req_id: str
    chunks: list[Chunk]
    is_async: bool = False


@dataclasses.dataclass
class Scenario:
    kv: torch.Tensor  # [layers, 2, tokens, heads, head] canonical, CPU
    chunk_size: int
    block_size: int
    num_blocks: int
    addresses: ObjectAddresses
    store: object
    specs: list[Spec]
    codecs: list[str | Precision]
    index: dict[str, int]  # chunk hash -> chunk number in kv

    @property
    def variants(self) -> dict[str, ObjectAddresses]:
        """The lossy levels' objects are under the scenario's own keys: a fetcher's ``variants`` (it reads a lossy
        object only as the level it is, never as lossless)."""
        return {level_name(c): self.addresses for c in self.codecs if lossy(c)}

    @property
    def geometry(self) -> Geometry:
        _, _, _, heads, head = self.kv.shape
        return Geometry(num_kv_heads=heads, head_size=head, block_size=self.block_size, dtype=self.kv.dtype)

    def caches(self, device: torch.device | str, order: str = "NHD") -> list[torch.Tensor]:
        """Zeroed packed caches, one logical ``[blocks, heads, block_size, 2*head]`` view per layer."""
        layers, _, _, heads, head = self.kv.shape
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}")
        phys = (self.num_blocks, self.block_size, heads, 2 * head) if order == "NHD" else (self.num_blocks, heads, self.block_size, 2 * head)
        # one allocation for all layers, as vLLM does, so per-layer views share strides
        whole = torch.zeros((layers, *phys), dtype=self.kv.dtype, device=device)
        return [whole[i].transpose(1, 2) if order == "NHD" else whole[i] for i in range(layers)]

    def expected(self, failed_chunks: set[tuple[str, int]] = frozenset()) -> list[torch.Tensor]:
        """What a correct load leaves in the caches (CPU, layout scatter); ``failed_chunks``: (hash, group) left out.

        A lossy object's values are what the CPU decoder makes of it (the reference dequantisation), not the KV.
        """
        caches = self.caches("cpu")
        layout = PackedKVLayout(self.geometry)
        for spec in self.specs:
            for chunk in spec.chunks:
                c = self.index[chunk.chunk_hash]
                slots = torch.tensor(chunk.slots, dtype=torch.int64)
                for g, layers in enumerate(self.addresses.groups):
                    if (chunk.chunk_hash, g) in failed_chunks:
                        continue
                    if lossy(self.codecs[c % len(self.codecs)]):
                        kv, at = decode_chunk(self.store.get(self.addresses.key(chunk.chunk_hash, g))), -layers.start
                    else:
                        kv, at = self.kv[:, :, c * self.chunk_size : (c + 1) * self.chunk_size], 0
                    for layer in layers:
                        part = kv[layer + at, :, chunk.first_token : chunk.first_token + len(chunk.slots)].contiguous()
                        layout.scatter(caches[layer], slots, part)
        return caches


def lossy(codec: str | Precision) -> bool:
    """Whether ``codec`` (a name in :func:`build`'s ``codecs``) is a lossy precision level rather than a codec."""
    return isinstance(codec, Precision) or codec in LEVELS


def level_name(codec: str | Precision) -> str:
    """The precision a chunk of ``codec`` is read as: its lossy level's name, else lossless."""
    if isinstance(codec, Precision):
        return codec.name
    return codec if codec in LEVELS else LOSSLESS


def build(kv: torch.Tensor, *, chunk_size: int, layers_per_object: int, block_size: int,
          codecs: list[str | Precision], first_token: int = 0, requests: int = 2, seed: int = 0) -> Scenario:
    """Store every chunk of ``kv`` (codec per chunk, cycling through ``codecs``: a codec, or a lossy precision
    level, LOSSY: NOT BIT-EXACT, by name or as a :class:`~vllm_kvcodec.codecs.precision.Precision`) and plan loading them.

    The chunks are split over ``requests`` requests; each request's blocks
    are drawn at random (non-contiguous, shuffled) from a cache with spare
    blocks, and its first chunk loads from ``first_token`` on (the tokens
    before it stay where vLLM's own prefix cache has them: not written).
    """
    layers, _, tokens, heads, head = kv.shape
    if tokens % chunk_size or chunk_size % block_size:
        raise ValueError("tokens must be whole chunks and chunks whole blocks")
    ns = Namespace(model_id="load-check", dtype=str(kv.dtype).removeprefix("torch."), num_layers=layers,
                   num_kv_heads=heads, head_dim=head, layout_id="canonical-v1", tp_size=1,
                   chunk_size=chunk_size, layers_per_object=layers_per_object)
    groups = tuple(ns.layer_groups())
    addresses = ObjectAddresses(ns, 0, groups)
    store = open_store(f"memory://load-check-{seed}-{time.monotonic_ns()}")
    num_chunks = tokens // chunk_size
    hashes = [f"{seed:08x}{c:024x}" for c in range(num_chunks)]
    for c, h in enumerate(hashes):
        codec = codecs[c % len(codecs)]
        part = kv[:, :, c * chunk_size : (c + 1) * chunk_size]
        how = {"precision": codec} if lossy(codec) else {"codec": codec}
        store.put_many([(addresses.key(h, g), encode_chunk(part[r.start : r.stop].contiguous(), key=addresses.key(h, g), **how))
                        for g, r in enumerate(groups)])
    gen = torch.Generator().manual_seed(seed)
    blocks_per_chunk = chunk_size // block_size
    num_blocks = 2 * num_chunks * blocks_per_chunk + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    specs, per_req = [], -(-num_chunks // requests)
    for r in range(requests):
        mine = list(range(r * per_req, min((r + 1) * per_req, num_chunks)))
        if not mine:
            continue
        table = [free.pop() for _ in range(len(mine) * blocks_per_chunk)]
        chunks = []
        for i, c in enumerate(mine):
            first = first_token if i == 0 else 0
            pos = range(i * chunk_size + first, (i + 1) * chunk_size)
            slots = [table[p // block_size] * block_size + p % block_size for p in pos]
            blocks = sorted({s // block_size for s in slots})
            chunks.append(Chunk(hashes[c], first, slots, blocks, precisions=(level_name(codecs[c % len(codecs)]),)))
        specs.append(Spec(f"req-{r}", chunks))
    return Scenario(kv, chunk_size, block_size, num_blocks, addresses, store, specs, codecs,
                    {h: c for c, h in enumerate(hashes)})


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def caches_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(bits(g.cpu()), bits(w)) for g, w in zip(got, want))


__all__ = ["ORDERS", "Chunk", "Scenario", "Spec", "bits", "build", "caches_equal", "lossy"]


def swap_escape_positions(blob: bytes, key: str) -> bytes:
    """The same splitzip chunk with two escape positions swapped: a valid checksum and binding, invalid content.

    Only the device decoder's flags can catch it, which is what the tests and the device check want to see.
    """
    from vllm_kvcodec.format import build_chunk, read_header

    head = read_header(blob, key=key)
    payload = bytearray(memoryview(blob)[head.payload_offset : head.payload_offset + head.payload_length])
    n = 1
    for d in head.shape:
        n *= d
    if int.from_bytes(payload[16:20], "little") < 2:
        raise ValueError("the chunk has fewer than two escapes to swap")
    at = 20 + (n + 1) // 2 + n
    payload[at : at + 4], payload[at + 4 : at + 8] = payload[at + 4 : at + 8], payload[at : at + 4]
    return build_chunk(bytes(payload), head.dtype, head.shape, head.codec_config, key=key)


def save_chunks(save: Any, caches: list[torch.Tensor], chunks: list[Any]) -> None:
    """Drive a save gather as the worker does: every layer as ``save_kv_layer`` sees it, then the end of the step."""
    specs = [SimpleNamespace(req_id=f"r{i}", chunk_hash=c.chunk_hash, group_slots=[c.slots], tokens=len(c.slots)) for i, c in enumerate(chunks)]
    for layer in range(len(caches)):
        save.gather_layer(layer, caches[layer], specs)
    left = save.end_step(specs, lambda spec: True)
    if left:
        raise AssertionError(f"chunks not handed to the saver: {[(s.chunk_hash[:8], why) for s, why in left]}")
    save.flush()
