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

On a CUDA engine the fetcher does not decode every codec on CPU threads: bf16
SplitZip decodes in Triton kernels on the device and ``video`` (HEVC) in the
GPU's NVDEC engines; only rans, zstd and raw run on the CPU threads. So each
candidate is calibrated through the :class:`DecodePath` the fetcher will take
(:func:`cuda_decode_paths`): the same blob decoded the same way, timed to the
device's completion, with the parallelism of that path (one GPU; NVDEC's
engines; the decode threads). A device path takes no CPU core from a CPU
prefill (there is none on a GPU engine anyway), so its time is never charged
as thread-seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm_kvcodec.codecs import Codec, get_codec
from vllm_kvcodec.save.link_estimate import LinkEstimate
from vllm_kvcodec.codecs.policy import AUTO, AUTO_CANDIDATES, encode_rank
from vllm_kvcodec.format import decode_chunk, encode_chunk

if TYPE_CHECKING:
    from storage import Store

logger = logging.getLogger("vllm_kvcodec")


class DecodePath(NamedTuple):
    """How the fetcher decodes one codec's chunks here: a call that decodes a blob completely (device work
    finished when it returns), how many run at once, and where (named in the log)."""

    decode: Callable[[bytes], Any]
    parallel: int
    where: str


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
        # Codecs the fetcher decodes other than on its CPU threads (a CUDA engine: cuda_decode_paths).
        self.decode_paths: dict[str, DecodePath] = {}
        self._where: dict[str, str] = {}

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

    def path_for(self, codec_id: str) -> DecodePath:
        """The decode path of ``codec_id``: the device's where one is set, else the CPU decode on the decode threads."""
        return self.decode_paths.get(codec_id) or DecodePath(decode_chunk, self.decoders, "cpu")

    def _calibrate(self, sample: torch.Tensor) -> None:
        raw = sample.numel() * sample.element_size()
        for codec in self.candidates:
            blob = encode_chunk(sample, self._for(codec, sample))
            path = self.path_for(codec.codec_id)
            path.decode(blob)  # untimed: JIT dispatch, caches, first-touch pages, a decoder session
            decode_s = max(min(_timed(path.decode, blob) for _ in range(3)), 1e-9)
            entry = {"ratio": raw / len(blob), "decode_Bps": raw / decode_s}
            if codec.codec_id in self.decode_paths:  # CPU paths take the decoder count at decision time
                entry.update(parallel=path.parallel, on_cpu=False)
            self.profile[codec.codec_id] = entry
            self._where[codec.codec_id] = path.where

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
        return expected_seconds_per_byte(
            p["ratio"], p["decode_Bps"], self.bandwidth_bytes_per_s, int(p.get("parallel", self.decoders)),
            on_cpu=bool(p.get("on_cpu", True)), reads_cost_cpu=self.reads_cost_cpu,
            decode_takes_prefill_cores=self.decode_takes_prefill_cores)

    def _log_choice(self, codec: Codec) -> None:
        figures = ", ".join(
            f"{cid}: {p['ratio']:.3f}x, decode {p['decode_Bps'] / 1e6:.0f} MB/s x{int(p.get('parallel', self.decoders))} "
            f"on {self._where.get(cid, 'cpu')}" for cid, p in self.profile.items()
        )
        logger.info(
            "kvcodec auto: link %.2f Gbit/s -> saving with %s (%s)",
            self.bandwidth_bytes_per_s * 8 / 1e9, codec.codec_id, figures,
        )


#: The object codec ``auto`` reads back at start-up to learn the store's read bandwidth (34 ms at 1 Gbit/s).
PROBE_BYTES = 4 << 20


def probe_link(store: "Store", key: str, chooser: CodecChooser, probes: int = 3) -> None:
    """What ``auto`` needs before the first load: the store's latency (empty lookups, which no transfer must read as
    bandwidth) and its read bandwidth (a probe object put under ``key``, which no chunk has, read back, deleted).

    A saving instance otherwise knows only its puts, which run far below
    its reads (a file store writing pages): auto then saved denser codecs
    where raw loaded fastest. A store that refuses the probe (read-only,
    down) leaves the estimate to the transfers that follow.
    """
    try:
        for _ in range(probes):
            t0 = time.perf_counter()
            store.exists_many([key])
            chooser.observe_round_trip(time.perf_counter() - t0)
        store.put(key, bytes(PROBE_BYTES))
        try:
            for _ in range(probes):
                t0 = time.perf_counter()
                blob = store.get(key)
                t1 = time.perf_counter()
                chooser.observe_read(len(blob or b""), t1 - t0, end=t1)
        finally:
            store.delete(key)
    except Exception as exc:  # noqa: BLE001 - a store not up yet: auto starts from its initial figure
        logger.info("kvcodec auto: probing the store failed (%s); the link estimate starts from transfers", exc)


def expected_seconds_per_byte(ratio: float, decode_Bps: float, link_Bps: float, parallel: int, *, on_cpu: bool,
                              reads_cost_cpu: bool, decode_takes_prefill_cores: bool) -> float:
    """Seconds per raw byte a load of this codec is expected to take (the module docstring's model).

    ``parallel`` decodes run at once on this codec's path; a device path
    (``on_cpu`` False) neither shares cores with the reads nor takes them
    from a CPU prefill, so it only overlaps with the read.
    """
    read = 1.0 / (ratio * link_Bps)
    if on_cpu and decode_takes_prefill_cores:  # thread-seconds, whatever the decoder count
        return read + 1.0 / decode_Bps
    decode = 1.0 / (decode_Bps * max(1, parallel))
    return read + decode if reads_cost_cpu and on_cpu else max(read, decode)


def cuda_decode_paths(device: torch.device, decode_threads: int) -> dict[str, DecodePath]:
    """The decode paths of a CUDA engine's fetcher: Triton SplitZip on ``device`` (bf16), and NVDEC for ``video``
    where it works here (as many sessions as the GPU has NVDEC engines, at most the threads). Codecs left out
    decode on the CPU threads."""
    from vllm_kvcodec.format.device_chunks import SplitZipGPU, decode_video_chunk_nvdec
    from vllm_kvcodec.gpu import nvcodec

    gpu = SplitZipGPU()

    def on_device(blob: bytes) -> None:
        gpu.decode_chunk_gpu(blob, device)
        torch.cuda.synchronize(device)

    paths = {"splitzip": DecodePath(on_device, 1, f"{device} (Triton)")}
    ok, _ = nvcodec.nvdec_available()
    if ok:
        from vllm_kvcodec.gpu.nvdec_sessions import NvdecSession, SessionPool, nvdec_engines

        sessions = SessionPool(lambda: NvdecSession(device), 1)  # one decoder per picture size, reused

        def nvdec(blob: bytes) -> None:
            decode_video_chunk_nvdec(blob, device, session=sessions)
            torch.cuda.synchronize(device)

        paths["video"] = DecodePath(nvdec, min(nvdec_engines(device), max(1, decode_threads)), f"{device} (NVDEC)")
    return paths


def with_token_axis(codec: Codec, axis: int | None) -> Codec:
    """``codec`` told which axis holds tokens, where it models channels and was not told already (rans)."""
    if axis is None or getattr(codec, "token_axis", axis) is not None:
        return codec
    return get_codec({**codec.get_config(), "token_axis": axis})


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0
