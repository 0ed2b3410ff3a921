"""The worker half's precisions: where each precision's objects are, how a lossy level's are made, and what
``precision: auto`` learns of the link (see connector/precisions.py for the namespaces).

Under ``auto`` the worker measures what a load of each precision costs
(:class:`~vllm_kvcodec.save.precision_choice.ReadCosts`: the store's read
bandwidth from its reads and a probe at start-up, each precision's bytes and
decode speed from its saves and loads) and tells the scheduler half, which
chooses per chunk: at the handshake, then whenever the figures move.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.connector.precisions import Precisions
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.paged.objects import ObjectLayout
from vllm_kvcodec.save.codec_choice import CodecChooser, probe_link
from vllm_kvcodec.save.lossy_objects import LossyObjects
from vllm_kvcodec.save.precision_choice import ReadCosts
from vllm_kvcodec.stats import ConnectorStats

if TYPE_CHECKING:
    from storage import Store
    from vllm_kvcodec.paged import PagedLayout


class WorkerPrecisions:
    """One worker's precisions, built once its KV caches are registered."""

    def __init__(self, precisions: Precisions, lossless: ObjectAddresses, objects: ObjectLayout,
                 layout: "PagedLayout", chooser: CodecChooser, stats: ConnectorStats) -> None:
        """``lossless``: this worker's addresses in the engine's own namespace; ``objects``, ``layout``: what its
        gathered chunks hold (the engine's object layout, and the pages' layout to read them as canonical KV)."""
        self.precisions = precisions
        self.addresses = {name: self._addresses(lossless, precisions.namespace(lossless.namespace, name))
                          for name in precisions.names()}
        self.lossy: LossyObjects | None = None
        if precisions.level is not None:
            global_groups = lossless.namespace.layer_groups()
            firsts = [global_groups[lossless.first_group + g].start for g in range(len(lossless.groups))]
            self.lossy = LossyObjects(precisions.level, {precisions.level.name: self.addresses[precisions.level.name]},
                                      lambda kv: objects.canonical(kv, layout), firsts, stats, chooser.fixed)
        self.costs: ReadCosts | None = None
        if precisions.variant is not None:
            bits = DType.parse(lossless.namespace.dtype).itemsize * 8
            self.costs = ReadCosts(chooser.link, precisions.names(), bits, chooser.decoders)
            self.costs.reads_cost_cpu = chooser.reads_cost_cpu
            self.costs.decode_takes_prefill_cores = chooser.decode_takes_prefill_cores

    @staticmethod
    def _addresses(lossless: ObjectAddresses, namespace: Namespace) -> ObjectAddresses:
        if namespace is lossless.namespace:
            return lossless
        return ObjectAddresses(namespace, lossless.tp_rank, lossless.groups, lossless.first_group)

    def variants(self) -> dict[str, ObjectAddresses]:
        """The addresses of every precision but lossless (the fetcher's and saver's own)."""
        return {name: a for name, a in self.addresses.items() if name != LOSSLESS}

    def probe(self, store: "Store", chooser: CodecChooser, probed: bool) -> None:
        """auto needs the store's read bandwidth before the first load (``probed``: the codec choice did it)."""
        if self.costs is not None and not probed:
            probe_link(store, self.addresses[LOSSLESS].key(os.urandom(16).hex(), 0), chooser)

    def observe_load(self, precision: str, stored: int, raw: int, decode_s: float) -> None:
        if self.costs is not None:
            self.costs.observe(precision, stored, raw, decode_s)

    def observe_save(self, precision: str, stored: int, raw: int) -> None:
        if self.costs is not None:
            self.costs.observe(precision, stored, raw)

    def report(self) -> dict[str, float] | None:
        """auto's costs where they moved since they were last told (the first time: at the handshake, so the first
        loads choose by the link too)."""
        return self.costs.report() if self.costs is not None else None
