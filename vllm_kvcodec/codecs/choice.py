"""Which codec to save with: fixed by config, or ``auto`` from measured link and codec speeds.

``auto`` minimises the expected time to load a chunk. The fetcher overlaps
transfer and decoding across its threads, so that time is the slower of the
two stages: ``max(raw / (ratio * link), raw / (decode_speed * decoders))``.
Where the store's reads are memory copies on this host (a local file store:
``reads_cost_cpu``), reading and decoding take the same cores, so the two
add up instead: on 2 cores a 4096-token prefix replayed from the local disk
took 1.8x the local hit raw against 2.4-2.5x with zstd, splitzip or rans.
Where a CPU engine's threads take every core and loads may run beside its
prefill (``decode_takes_prefill_cores``), every thread-second of decoding is
taken from the prefill's OpenMP team, however many threads share it, while
the wire time can hide under the prefill: the decode's thread-seconds add to
the read. At 10 Gbit/s on 2 cores (4096-token prefix, load_wait auto) raw
took 142 ms and zstd 164-173 ms, which the overlapped model had ranked the
other way round.
On a fast link raw wins (nothing to decode), on a slow one the densest codec
does. Each candidate's ratio and steady-state decode speed (after one untimed
warm-up decode, best of three) are measured once on this machine on the first
real chunk saved; the link bandwidth is what :mod:`.link_estimate` makes of
this process's reads (the fetcher's, and the worker's probe at start-up),
and of its writes until a read is seen. Every change of choice is logged
with the figures behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_kvcodec.codecs import Codec, get_codec
from vllm_kvcodec.codecs.link_estimate import LinkEstimate
from vllm_kvcodec.codecs.policy import AUTO, AUTO_CANDIDATES, encode_rank
from vllm_kvcodec.format import decode_chunk, encode_chunk

logger = logging.getLogger("vllm_kvcodec")


class CodecChooser:
    def __init__(
        self, spec: str | dict[str, Any], candidates: tuple[str | dict[str, Any], ...] = AUTO_CANDIDATES,
        initial_gbps: float = 10.0, decoders: int = 1, behind: Codec | None = None,
    ) -> None:
        self.auto = spec == AUTO
        self.behind = behind  # faster to encode, for chunks saved while a round of saves waits behind them
        self.decoders = max(1, decoders)  # threads that decode in parallel (at most the cores)
        self.reads_cost_cpu = False  # the store's reads are memory copies on this host: read and decode times add
        self.decode_takes_prefill_cores = False  # decoding runs on the cores of a CPU engine's prefill
        self.fixed: Codec | None = None if self.auto else get_codec(spec)
        self.candidates = [get_codec(c) for c in candidates]
        self.profile: dict[str, dict[str, float]] = {}
        self.link = LinkEstimate(initial_gbps * 1e9 / 8)  # bytes/s: the initial figure until measured
        self._lock = threading.Lock()
        self._current: Codec | None = None
        # Which axis of a stored object a per-channel codec reads as tokens (the object layout's say).
        self.token_axis: Callable[[int], int | None] = lambda ndim: None

    # ---- observations ---------------------------------------------------------------
    def observe_round_trip(self, seconds: float) -> None:
        """A store call that moved no bytes: latency, which later transfers are taken net of."""
        self.link.observe_round_trip(seconds)

    def observe_read(self, nbytes: int, seconds: float, end: float | None = None) -> None:
        self.link.observe(nbytes, seconds, read=True, end=end)

    def observe_write(self, nbytes: int, seconds: float, end: float | None = None) -> None:
        self.link.observe(nbytes, seconds, read=False, end=end)

    @property
    def current_id(self) -> str | None:
        """The codec new chunks are saved with now (auto: its latest choice; None before the first)."""
        codec = self.fixed if self.fixed is not None else self._current
        return None if codec is None else codec.codec_id

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.link.bytes_per_s

    def _calibrate(self, sample: torch.Tensor) -> None:
        raw = sample.numel() * sample.element_size()
        for codec in self.candidates:
            blob = encode_chunk(sample, self._for(codec, sample))
            decode_chunk(blob)  # untimed: JIT dispatch, caches and first-touch pages
            decode_s = max(min(_timed(decode_chunk, blob) for _ in range(3)), 1e-9)
            self.profile[codec.codec_id] = {"ratio": raw / len(blob), "decode_Bps": raw / decode_s}

    # ---- decision -------------------------------------------------------------------
    def codec_for(self, sample: torch.Tensor, behind: bool = False) -> Codec:
        """The codec to save ``sample``'s chunk with; ``behind``: the saver has a full round queued after it.

        Behind, the cheaper codec replaces only a codec that is slower to encode
        (a saver configured with raw or splitzip keeps it).
        """
        chosen = self.fixed if self.fixed is not None else self._auto_choice(sample)
        if behind and self.behind is not None and encode_rank(self.behind) < encode_rank(chosen):
            chosen = self.behind
        return self._for(chosen, sample)

    def _auto_choice(self, sample: torch.Tensor) -> Codec:
        with self._lock:
            if not self.profile:
                self._calibrate(sample)
            best = min(self.candidates, key=self._expected_seconds_per_byte)
            if best != self._current:
                self._log_choice(best)
                self._current = best
            return best

    def _for(self, codec: Codec, sample: torch.Tensor) -> Codec:
        return with_token_axis(codec, self.token_axis(sample.dim()))

    def _expected_seconds_per_byte(self, codec: Codec) -> float:
        p = self.profile[codec.codec_id]
        read = 1.0 / (p["ratio"] * self.bandwidth_bytes_per_s)
        if self.decode_takes_prefill_cores:  # thread-seconds, whatever the decoder count
            return read + 1.0 / p["decode_Bps"]
        decode = 1.0 / (p["decode_Bps"] * self.decoders)
        return read + decode if self.reads_cost_cpu else max(read, decode)

    def _log_choice(self, codec: Codec) -> None:
        figures = ", ".join(
            f"{cid}: {p['ratio']:.3f}x, decode {p['decode_Bps'] / 1e6:.0f} MB/s" for cid, p in self.profile.items()
        )
        logger.info(
            "kvcodec auto: link %.2f Gbit/s -> saving with %s (%s)",
            self.bandwidth_bytes_per_s * 8 / 1e9, codec.codec_id, figures,
        )


def with_token_axis(codec: Codec, axis: int | None) -> Codec:
    """``codec`` told which axis holds tokens, where it models channels and was not told already (rans)."""
    if axis is None or getattr(codec, "token_axis", axis) is not None:
        return codec
    return get_codec({**codec.get_config(), "token_axis": axis})


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0
