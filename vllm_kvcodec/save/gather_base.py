"""What every save gather is, apart from where it copies: the interface, the budget rules, the end-of-step rules.

Its own module so the CPU gather (:mod:`.gather`) and the CUDA gather
(:mod:`.cuda_gather`) both import it and neither imports the other; the
factory :func:`~vllm_kvcodec.save.gather.save_gather_for` sees both.
:class:`SaveSink` names the calls a gather makes on the
:class:`~vllm_kvcodec.save.saver.Saver`, so a stand-in (the GPU device check
runs without a store) and the real Saver are held to the same signatures.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vllm_kvcodec.plans.outcomes import SaveOutcome
from vllm_kvcodec.paged.objects import CanonicalObjects, ObjectLayout

if TYPE_CHECKING:
    from vllm_kvcodec.format import TokenDigests
    from vllm_kvcodec.gpu.block_reads import BlockReads
    from vllm_kvcodec.paged import PagedLayout


class SaveSink(Protocol):
    """What a gather calls on the Saver (:class:`~vllm_kvcodec.save.saver.Saver` is the product's one)."""

    report: Callable[[SaveOutcome], None]

    def reserve(self, nbytes: int) -> bool: ...

    def unreserve(self, nbytes: int) -> None: ...

    def submit(self, chunk_hash: str, kv: torch.Tensor, req_id: str = "", reserved: bool = False,
               tokens: int | None = None, refs: Sequence[tuple[str, int]] = (),
               digests: "TokenDigests | None" = None, hold: Collection[int] = (),
               precisions: Sequence[str] = ("lossless",), first_chunk: bool = False) -> bool: ...


#: ``(req_id, chunk_hash, group_slots)`` of one chunk to save (a :class:`~vllm_kvcodec.plans.saves.SaveSpec`).
SaveSpecLike = Any


def chunk_nbytes(layouts: Sequence["PagedLayout"], tokens: int) -> int:
    """Raw bytes one worker gathers for ``tokens`` of every layer (what the save budget counts)."""
    return len(layouts) * tokens * layouts[0].token_nbytes()


class SaveGather(abc.ABC):
    def __init__(self, caches: list[torch.Tensor], layouts: list["PagedLayout"], saver: SaveSink,
                 cache_groups: list[int] | None = None, objects: ObjectLayout | None = None) -> None:
        self.caches, self.layouts, self.saver = caches, layouts, saver
        self.cache_groups = cache_groups or [0] * len(caches)  # the vLLM KV cache group of each layer
        self.objects = objects if objects is not None else CanonicalObjects()  # what one stored object holds
        self._step: Sequence[SaveSpecLike] | None = None
        #: A GPU gather's reads of paged blocks, which a load into the same blocks must wait for (gpu/block_reads.py);
        #: None where copies finish before they return.
        self.block_reads: BlockReads | None = None
        self._admitted: dict[int, int] = {}  # save index -> reserved bytes
        self._layers_done: dict[int, int] = {}

    def chunk_nbytes(self, tokens: int) -> int:
        return chunk_nbytes(self.layouts, tokens)

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        """All layers of one chunk, as the object layout stores them (split into layer groups by the Saver)."""
        return self.objects.object_shape(len(self.caches), self.layouts[0], self.caches[0], tokens)

    # ---- per layer (save_kv_layer) --------------------------------------------------
    def gather_layer(self, layer: int, kv_layer: torch.Tensor, saves: Sequence[SaveSpecLike]) -> None:
        """Copy this layer's slots of every admitted chunk of the step."""
        if self._step is not saves:
            self._begin(saves)
        group = self.cache_groups[layer]
        for i in self._admitted:
            self._copy(i, layer, kv_layer, saves[i].group_slots[group])
            self._layers_done[i] = self._layers_done.get(i, 0) + 1

    def gather_unseen(self, saves: Sequence[SaveSpecLike]) -> None:
        """Copy every layer of the step's saves from the caches, unless a forward already did layer by layer.

        vLLM's step after a request finished may run no forward (nothing else
        scheduled) and so call no ``save_kv_layer``; the finishing tail
        (block_hits) is gathered here then, from blocks vLLM holds for it.
        """
        if self._step is saves:
            return
        for layer, cache in enumerate(self.caches):
            self.gather_layer(layer, cache, saves)

    def _begin(self, saves: Sequence[SaveSpecLike]) -> None:
        self._step, self._admitted, self._layers_done = saves, {}, {}
        for i, spec in enumerate(saves):
            nbytes = self.chunk_nbytes(len(spec.group_slots[0]))
            if self.saver.reserve(nbytes):
                self._admitted[i] = nbytes

    # ---- end of step (wait_for_save) ------------------------------------------------
    def end_step(self, saves: Sequence[SaveSpecLike], good: Callable[[SaveSpecLike], bool]) -> list[tuple[SaveSpecLike, str]]:
        """Hand complete chunks whose KV is ``good`` to the Saver; return the others with why they were not."""
        if self._step is not saves:
            self._begin(saves)  # a step whose forward saved no layer (nothing was gathered)
        left: list[tuple[SaveSpecLike, str]] = []
        for i, spec in enumerate(saves):
            nbytes = self._admitted.get(i)
            complete = nbytes is not None and self._layers_done.get(i, 0) == len(self.caches)
            if complete and good(spec):
                self._hand_over(i, spec, nbytes)
                continue
            if nbytes is not None:
                self.saver.unreserve(nbytes)
            reason = "no room" if nbytes is None else ("incomplete" if not complete else "load failed")
            left.append((spec, reason))
        self._finish_step()
        self._step, self._admitted, self._layers_done = None, {}, {}
        return left

    @abc.abstractmethod
    def _copy(self, index: int, layer: int, kv_layer: torch.Tensor, slots: list[int]) -> None: ...

    @abc.abstractmethod
    def _hand_over(self, index: int, spec: SaveSpecLike, nbytes: int) -> None: ...

    def _submit(self, spec: SaveSpecLike, kv: torch.Tensor) -> None:
        """Hand one gathered chunk (its bytes reserved) to the Saver with what its header and refs record, the
        loads whose every-worker outcome it waits for (:mod:`~vllm_kvcodec.save.held_saves`), and the precisions
        it is stored in."""
        self.saver.submit(spec.chunk_hash, kv, spec.req_id, reserved=True, tokens=spec.tokens,
                          refs=getattr(spec, "refs", ()), digests=getattr(spec, "digests", None),
                          hold=getattr(spec, "unsettled_loads", ()),
                          precisions=getattr(spec, "precisions", ("lossless",)),
                          first_chunk=getattr(spec, "first_chunk", False))

    def _finish_step(self) -> None:
        """Release per-step buffers (and, on a GPU, order the engine's stream after the gathers)."""

    def flush(self) -> None:
        """Wait until every handed-over chunk is on the Saver's queue."""

    def shutdown(self) -> None:
        """Stop background hand-off threads, if any."""
