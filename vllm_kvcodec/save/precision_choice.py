"""Which stored variant a load under ``precision: auto`` reads, chunk by chunk (LOSSY: NOT BIT-EXACT where it reads one).

KVCodec and CacheGen pick a chunk's quality from the bandwidth they measure
and the time the request can wait. Here every chunk is stored lossless (what
lookups check) and as a lossy variant; a load reads the lossless objects when
the measured link brings them within the request's budget, else the lossy
variant of as many of its *last* chunks as it takes (the first tokens stay
exact: attention leans on them hardest), all of them if even that is too slow.

The worker measures (:class:`ReadCosts`): the store's read bandwidth as the
``auto`` codec choice sees it (:mod:`vllm_kvcodec.save.link_estimate`: this
worker's recent reads, the start-up probe), and per precision the stored
bytes per raw byte (from the objects it saves and loads) and the decode
seconds per raw byte (from the objects it loads), combined with the same
model as the codec choice (:func:`~vllm_kvcodec.save.codec_choice.expected_seconds_per_byte`).
It reports the seconds per raw byte of each precision to the scheduler half,
which decides (:func:`variant_from`), so every worker of a load reads the same
variant and the saves planned with it know whether the KV they rest on is
lossy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from vllm_kvcodec.codecs.precision import LEVELS, LOSSLESS
from vllm_kvcodec.save.codec_choice import expected_seconds_per_byte
from vllm_kvcodec.save.link_estimate import LinkEstimate

#: Weight of a new observation in the running figures (about the last ten objects count).
SMOOTHING = 0.1
#: A change of any precision's cost by more than this share is reported to the scheduler half.
REPORT_CHANGE = 0.1


class ReadCosts:
    """A worker's expected seconds per raw KV byte to load each precision's objects (thread-safe: the fetch, decode
    and save threads observe)."""

    def __init__(self, link: LinkEstimate, precisions: Sequence[str], source_bits: int, decoders: int = 1) -> None:
        self.link, self.decoders = link, decoders
        self.reads_cost_cpu = False  # as the codec chooser's: the store's reads are memory copies on this host
        self.decode_takes_prefill_cores = False
        # Before any object is seen: lossless as raw, a level at its bits (int8 of bf16: 2x); no decode time.
        self._ratio = {p: (source_bits / LEVELS[p] if p in LEVELS else 1.0) for p in precisions}
        self._decode_s_per_byte = {p: 0.0 for p in precisions}
        self._lock = threading.Lock()
        self._reported: dict[str, float] = {}

    def observe(self, precision: str, stored: int, raw: int, decode_s: float | None = None) -> None:
        """One object of ``precision``: ``stored`` bytes for ``raw`` bytes of KV, decoded in ``decode_s`` (a load)."""
        if precision not in self._ratio or stored <= 0 or raw <= 0:
            return
        with self._lock:
            self._ratio[precision] += SMOOTHING * (raw / stored - self._ratio[precision])
            if decode_s is not None:
                per = self._decode_s_per_byte[precision]
                self._decode_s_per_byte[precision] = decode_s / raw if not per else per + SMOOTHING * (decode_s / raw - per)

    def costs(self) -> dict[str, float]:
        """Expected seconds per raw byte of a load of each precision, on the link as measured now."""
        link = self.link.bytes_per_s
        with self._lock:
            figures = {p: (self._ratio[p], self._decode_s_per_byte[p]) for p in self._ratio}
        return {p: expected_seconds_per_byte(ratio, 1.0 / per if per else float("inf"), link, self.decoders,
                                             on_cpu=True, reads_cost_cpu=self.reads_cost_cpu,
                                             decode_takes_prefill_cores=self.decode_takes_prefill_cores)
                for p, (ratio, per) in figures.items()}

    def report(self) -> dict[str, float] | None:
        """The costs, when they moved by more than :data:`REPORT_CHANGE` since the last report (else None)."""
        costs = self.costs()
        last = self._reported
        if last and all(abs(costs[p] - last[p]) <= REPORT_CHANGE * last[p] for p in costs):
            return None
        self._reported = costs
        return costs


def variant_from(chunk_bytes: Sequence[int], costs: dict[str, float], variant: str, budget_s: float) -> int:
    """How many of a load's first chunks (``chunk_bytes``: raw bytes each, in order) to read lossless; the rest read
    ``variant``. All of them while the lossless load fits ``budget_s`` (or nothing is measured yet); otherwise the
    last chunks switch to the variant until it fits, all of them if it never does."""
    lossless, lossy = costs.get(LOSSLESS), costs.get(variant)
    if lossless is None or lossy is None or lossy >= lossless:
        return len(chunk_bytes)  # unmeasured, or the variant is no faster here (its decode outweighs its bytes)
    expected = sum(chunk_bytes) * lossless
    keep = len(chunk_bytes)
    while keep and expected > budget_s:
        keep -= 1
        expected -= chunk_bytes[keep] * (lossless - lossy)
    return keep


def merge_costs(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    """Two workers' costs as one load meets them: each precision at the slower worker's figure."""
    if not a or not b:
        return a or b
    return {p: max(a.get(p, 0.0), b.get(p, 0.0)) for p in a.keys() | b.keys()}
