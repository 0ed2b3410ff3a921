"""How one validated object reaches paged memory: a placement per medium, behind one fetcher.

The fetcher (:mod:`.fetcher`) fetches, validates and hands each object to
its placement, the way vLLM's offloading code keeps one worker contract with
a transfer handler per medium: :class:`HostPlacement` decodes on a thread
and writes through each layer's page layout;
:class:`~vllm_kvcodec.load.cuda_placement.CudaPlacement` stages, copies and
decodes on a side stream.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

import torch

from vllm_kvcodec.format import ChunkHeader, decode_payload
from vllm_kvcodec.load.load_job import LoadJob
from vllm_kvcodec.paged import PagedLayout
from vllm_kvcodec.paged.objects import CanonicalObjects, ObjectLayout, Target
from vllm_kvcodec.plans.spans import Span

if TYPE_CHECKING:
    from vllm_kvcodec.gpu.block_reads import BlockReads
    from vllm_kvcodec.gpu.dequant_triton import QuantizedKV
    from vllm_kvcodec.plans.loads import ChunkLoad


@dataclasses.dataclass
class Decoded:
    """One object's KV (the object layout's shape), or a lossy object's integers and scales on the device (which
    its scatter dequantises), and, per KV cache group, the chunk's span there."""

    kv: torch.Tensor | QuantizedKV
    spans: list[Span]  # one per KV cache group: where its tokens start in the chunk, and their slots
    on_device: bool = False  # decoded by a device kernel (counted as gpu_decoded_objects)
    device_slots: list[torch.Tensor] | None = None  # the spans' slots, already where the caches are (CUDA)
    objects: ObjectLayout | None = None  # what it holds where not the placement's own (a lossy precision's canonical KV)


class Placement(abc.ABC):
    """How one validated object reaches paged memory on one medium."""

    def __init__(self, caches: list[torch.Tensor], layouts: list[PagedLayout], cache_groups: list[int] | None = None) -> None:
        self.caches, self.layouts = caches, layouts
        self.cache_groups = cache_groups or [0] * len(caches)  # the vLLM KV cache group of each layer
        self.objects: ObjectLayout = CanonicalObjects()  # the fetcher sets its namespace's
        #: The save path's reads of paged blocks (a GPU gather's, gpu/block_reads.py): set by the worker half.
        self.block_reads: BlockReads | None = None

    def new_job(self, group_layers: list[list[int]], objects_per_group: int, req_ids: list[str]) -> LoadJob:
        return LoadJob(group_layers, objects_per_group, req_ids)

    @abc.abstractmethod
    def decode(self, blob: bytes, header: ChunkHeader, spans: list[Span]) -> Decoded:
        """Decode the object (untrusted beyond its header) next to the caches; raise on anything invalid."""

    @abc.abstractmethod
    def scatter(self, layers: range, decoded: Decoded) -> None:
        """Write each layer's span of the decoded object into its group's slots."""

    def shutdown(self) -> None:
        """Release streams or staging memory, if any."""

    def order_after_reads(self, chunks: list[ChunkLoad]) -> None:
        """Before any write of these loads is enqueued: order them after the save path's reads of their blocks
        (nothing to order where copies finish before they return)."""

    def objects_of(self, decoded: Decoded) -> ObjectLayout:
        """The object layout ``decoded`` is in: its own, or the placement's."""
        return decoded.objects or self.objects

    def write_layers(self, layers: range, decoded: Decoded) -> None:
        """Each layer's part of ``decoded`` through the object layout, its group's span checked once per object."""
        objects = self.objects_of(decoded)
        targets: dict[int, Target | None] = {}
        for part, layer in zip(decoded.kv.unbind(0), layers):
            group = self.cache_groups[layer]
            if group not in targets:
                span = decoded.spans[group]  # a window group may hold none of this chunk's blocks
                targets[group] = objects.target(self.layouts[layer], span.slots, span.first_token) if span.slots else None
            if (target := targets[group]) is not None:
                objects.write_to(self.layouts[layer], self.caches[layer], target, part)


class HostPlacement(Placement):
    """Caches in host memory: decode on a decode (or fetch) thread, scatter with each layer's page layout."""

    def decode(self, blob: bytes, header: ChunkHeader, spans: list[Span]) -> Decoded:
        return Decoded(decode_payload(blob, header, borrow=True), spans)  # only read: the scatter's source

    def scatter(self, layers: range, decoded: Decoded) -> None:
        self.write_layers(layers, decoded)
