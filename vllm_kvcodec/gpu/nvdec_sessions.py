"""NVDEC decoder sessions for the load path: one per picture size, reused for every ``video`` object of that size.

Creating an NVDEC decoder (``cuvidCreateDecoder`` plus PyNvVideoCodec's
set-up) takes milliseconds and device memory for its surfaces; a chunk's
stream decodes in far less. So a session is made once and fed stream after
stream: every ``video`` stream is all-intra, each picture an IDR with its
parameter sets in the first packet, so the next stream needs no reset.

**One picture size per session.** A decoder is sized by its first stream: a
smaller picture later is reconfigured and *scaled up* to the first size (the
frame comes back at the old size), a larger one raises "Reconfigure Not
supported when width/height > maxwidth/maxheight" (and in some builds that
error, thrown inside the parser's callback, aborts the process). Picture
height follows the token count (1024 rows for a 256-token SmolLM2 chunk,
fewer for prompt and finishing tails), so :class:`NvdecSession` fixes its
size at its first stream (``maxwidth``/``maxheight`` = that size) and refuses
any other, and :class:`SessionPool` hands out sessions by size, closing the
least recently used idle session of another size when it needs room.

**How many.** The pool holds at most ``min(NVDEC engines, fetch threads)``
sessions (more than the engines only queue inside the driver), the engines
from ``GetDecoderCaps`` (:func:`decoder_caps`), else a table by GPU name,
whichever session factory is used (the product's, or a stand-in's in the
tests and the dry run).

PyNvVideoCodec versions: ``vllm==0.33.0`` pins 2.0.4 and the latest is 2.2.4.
:class:`NvdecSession` uses only calls both offer (read from both wheels:
``CreateDecoder(gpuid, codec, cudacontext, cudastream, usedevicememory,
maxwidth, maxheight, latency)``, a ``PacketData()`` whose
``bsl_data``/``bsl``/``decode_flag`` the caller sets,
``VideoPacketFlag.ENDOFPICTURE``, ``DisplayDecodeLatencyType.ZERO``,
``cudaVideoCodec.HEVC``, ``cudaVideoChromaFormat`` member ``444`` (no
``YUV444``), ``GetDecoderCaps(...)`` returning a dict, frames through DLPack).
The 2.0.4 wheel reports ``__version__ == "2.1.1"``, so nothing here branches
on the version string.

Ordering: the decoder writes its pictures on the session's own CUDA stream
into its own frame buffers, which its next ``Decode`` overwrites. After each
``Decode`` the caller's current stream (the load path's side stream) waits
for that stream and copies the pictures out; the session's stream then waits
for the copies before the next ``Decode``. No host synchronisation.

Errors: a ``PyNvVCExceptionUnsupported`` (this GPU cannot decode this codec or
size) raises :class:`~vllm_kvcodec.gpu.nvcodec.NvCodecUnavailable`, which
turns NVDEC off for the process (logged once; the CPU decodes); any other
decoder error is damage (:class:`~vllm_kvcodec.errors.CodecError`: that object
fails, its session is replaced).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

from vllm_kvcodec.errors import CodecError
from vllm_kvcodec.gpu import nvcodec

logger = logging.getLogger("vllm_kvcodec")

#: NVDEC engines by device name, where ``GetDecoderCaps`` does not say (NVIDIA's NVDEC support matrix).
NVDEC_ENGINES = {"H200": 7, "H100": 7, "H20": 7, "H800": 7, "GH200": 7, "A100": 5, "A800": 5, "A30": 4,
                 "L40S": 3, "L40": 3, "L20": 3, "L4": 4, "A10": 2, "T4": 2}


class PlanesSession(Protocol):
    """One decoder, reused stream after stream (of one picture size)."""

    def decode_into(self, packets: list[memoryview], width: int, height: int, out: torch.Tensor) -> None:
        """Decode one picture per packet into ``out`` ``[frames, 3, height, width]`` uint8 (the device's).

        Work is enqueued so that what the caller's current stream does next
        sees the pictures. Raises :class:`CodecError` for a stream that does
        not give exactly ``len(packets)`` 4:4:4 pictures of that size, and
        :class:`~vllm_kvcodec.gpu.nvcodec.NvCodecUnavailable` when the decoder
        itself cannot be used here.
        """

    def close(self) -> None:
        """Release the decoder."""


def _unsupported(nvc: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is PyNvVideoCodec's "not supported" (by class, or by name where the module does not export it)."""
    cls = getattr(nvc, "PyNvVCExceptionUnsupported", None)
    return (isinstance(cls, type) and isinstance(exc, cls)) or type(exc).__name__ == "PyNvVCExceptionUnsupported"


class NvdecSession:
    """A PyNvVideoCodec decoder on one device for pictures of one size (fixed by its first stream), own stream."""

    def __init__(self, device: torch.device, nvc: Any | None = None) -> None:
        self.nvc = nvc if nvc is not None else nvcodec.import_nvc()
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.decoder: Any = None
        self.size: tuple[int, int] | None = None

    def _open(self, width: int, height: int) -> None:
        try:
            self.decoder = self.nvc.CreateDecoder(
                gpuid=self.device.index or 0, codec=self.nvc.cudaVideoCodec.HEVC, cudacontext=0,
                cudastream=self.stream.cuda_stream if self.stream is not None else 0,
                usedevicememory=True, maxwidth=width, maxheight=height,
                latency=self.nvc.DisplayDecodeLatencyType.ZERO)
        except Exception as exc:  # noqa: BLE001 - PyNvVCExceptionUnsupported and friends
            raise nvcodec.NvCodecUnavailable(f"CreateDecoder failed: {type(exc).__name__}: {exc}") from None
        self.size = (width, height)

    def decode_into(self, packets: list[memoryview], width: int, height: int, out: torch.Tensor) -> None:
        if self.size is None:
            self._open(width, height)
        elif self.size != (width, height):  # the pool never asks; NVDEC would scale or refuse
            raise ValueError(f"an NVDEC session for {self.size[0]}x{self.size[1]} pictures was handed {width}x{height}")
        frames, got = len(packets), 0
        for data in packets:
            got = self._take(self._decode(data, self.nvc.VideoPacketFlag.ENDOFPICTURE), got, frames, width, height, out)
        if got != frames:
            raise CodecError(f"HEVC stream decoded to {got} pictures, expected {frames}")

    def _decode(self, data: memoryview, flag: Any) -> list:
        buf = np.frombuffer(data, dtype=np.uint8)  # alive until Decode returns (the parser copies it)
        packet = self.nvc.PacketData()
        packet.bsl_data, packet.bsl, packet.decode_flag = buf.ctypes.data, buf.size, flag
        try:
            return list(self.decoder.Decode(packet))
        except Exception as exc:  # noqa: BLE001 - PyNvVCException* on a damaged stream
            if _unsupported(self.nvc, exc):
                raise nvcodec.NvCodecUnavailable(f"NVDEC cannot decode here: {type(exc).__name__}: {exc}") from None
            raise CodecError(f"NVDEC could not decode the stream: {type(exc).__name__}: {exc}") from None

    def _take(self, decoded: list, got: int, frames: int, width: int, height: int, out: torch.Tensor) -> int:
        """Copy this ``Decode``'s pictures out now: the next ``Decode`` reuses the decoder's frame buffers."""
        if not decoded:
            return got
        if got + len(decoded) > frames:
            raise CodecError(f"HEVC stream holds more than the {frames} pictures promised")
        if self.stream is not None:  # the pictures are written on the session's stream
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for frame in decoded:
            nvcodec._frame_planes(frame, width, height, self.device, out=out[got])
            got += 1
        if self.stream is not None:  # the next Decode may reuse those buffers only after the copies
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return got

    def close(self) -> None:
        self.decoder = None


class NvdecSessions:
    """Makes :class:`NvdecSession` objects from one PyNvVideoCodec module (``None``: the real one; a stand-in in tests).

    ``nvc`` is what :class:`NvdecDecoders` asks for the engine count.
    """

    def __init__(self, nvc: Any | None = None) -> None:
        self.nvc = nvc

    def __call__(self, device: torch.device) -> NvdecSession:
        return NvdecSession(device, self.nvc)


class SessionPool:
    """At most ``size`` sessions, each for one key (a picture size), made on first need, one thread at a time each.

    An idle session is reused for its own key; a key with none idle gets a new
    session while fewer than ``size`` exist, else the least recently used idle
    session of another key is closed to make room, else the thread waits. A
    session whose decode raised is closed and replaced on a later take: a
    damaged stream may leave a decoder's parser mid-picture.
    """

    def __init__(self, factory: Callable[[], PlanesSession], size: int) -> None:
        self.factory, self.size = factory, max(1, size)
        self._idle: list[tuple[Hashable, PlanesSession]] = []  # least recently used first
        self._cond = threading.Condition()
        self.live = 0  # sessions that exist now (idle or taken)
        self.created = 0
        self.evicted = 0  # idle sessions closed to make room for another size

    @contextmanager
    def take(self, key: Hashable = None) -> Iterator[PlanesSession]:
        session = self._get(key)
        try:
            yield session
        except BaseException:
            self._drop(session)
            raise
        with self._cond:
            self._idle.append((key, session))
            self._cond.notify_all()

    def _get(self, key: Hashable) -> PlanesSession:
        with self._cond:
            while True:
                mine = next((i for i in range(len(self._idle) - 1, -1, -1) if self._idle[i][0] == key), None)
                if mine is not None:
                    return self._idle.pop(mine)[1]
                if self.live < self.size:
                    self.live += 1
                    break
                if self._idle:  # room, from the least recently used idle session of another size
                    _, old = self._idle.pop(0)
                    old.close()
                    self.live -= 1
                    self.evicted += 1
                    continue
                self._cond.wait()  # woken by a session put back, or dropped (then this thread makes one)
        try:
            session = self.factory()
        except BaseException:
            with self._cond:
                self.live -= 1
                self._cond.notify_all()
            raise
        self.created += 1
        return session

    def _drop(self, session: PlanesSession) -> None:
        session.close()
        with self._cond:
            self.live -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for _, session in idle:
            self._drop(session)


def chroma_444(nvc: Any) -> Any:
    """``cudaVideoChromaFormat``'s 4:4:4 member: named ``444`` in 2.0.4 (not an identifier, so through getattr)."""
    enum = nvc.cudaVideoChromaFormat
    member = getattr(enum, "444", None)
    if member is None:
        member = next((m for name, m in getattr(enum, "__members__", {}).items() if name.endswith("444")), None)
    if member is None:
        raise AttributeError(f"cudaVideoChromaFormat has no 4:4:4 member ({sorted(getattr(enum, '__members__', {}))})")
    return member


def decoder_caps(device: torch.device, nvc: Any | None = None) -> dict[str, Any]:
    """NVDEC's HEVC 4:4:4 8-bit caps on ``device``: ``supported``, ``engines``, min/max size, and their ``source``.

    From ``GetDecoderCaps``; where that fails (no driver, an older build),
    ``engines`` from :data:`NVDEC_ENGINES` by device name (else 1) and the
    reason in ``error``. Never raises.
    """
    caps: dict[str, Any] = {}
    try:
        nvc = nvc if nvc is not None else nvcodec.import_nvc()
        got = dict(nvc.GetDecoderCaps(gpuid=device.index or 0, codec=nvc.cudaVideoCodec.HEVC,
                                      chromaformat=chroma_444(nvc), bitdepth=8))
        caps = {"source": "GetDecoderCaps", "supported": bool(got.get("supported", 1)),
                "engines": int(got.get("num_decoder_engines", 0)),
                **{k: int(got[k]) for k in ("width_min", "height_min", "width_max", "height_max") if k in got}}
    except Exception as exc:  # noqa: BLE001 - no driver, an older build: the table
        caps = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    if caps.get("engines", 0) > 0:
        return caps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else ""
    key = next((k for k in sorted(NVDEC_ENGINES, key=len, reverse=True) if k in name), None)  # "H200" before "H20"
    return {**caps, "engines": NVDEC_ENGINES[key] if key else 1, "source": f"name table ({key})" if key else "default"}


def nvdec_engines(device: torch.device, nvc: Any | None = None) -> int:
    """NVDEC engines of ``device``: PyNvVideoCodec's decoder caps, else the table, else 1."""
    return int(decoder_caps(device, nvc)["engines"])


class NvdecDecoders:
    """The load path's NVDEC: a session pool where NVDEC works here, else None (the CPU decodes; logged once).

    ``factory(device)`` makes a session (default: NVDEC through PyNvVideoCodec);
    a factory with an ``nvc`` attribute (:class:`NvdecSessions`) is sized from
    that module's caps. The pool's size, whatever the factory:
    ``min(size or NVDEC engines, threads)`` (:attr:`sessions` once opened).
    """

    def __init__(self, device: torch.device, threads: int,
                 factory: Callable[[torch.device], PlanesSession] | None = None, size: int | None = None) -> None:
        self.device, self.threads = device, threads
        self._factory, self._size = factory, size
        self._pool: SessionPool | None = None
        self.unavailable: str | None = None
        self.sessions: int | None = None
        self._lock = threading.Lock()

    def pool(self) -> SessionPool | None:
        with self._lock:
            if self._pool is None and self.unavailable is None:
                self._pool = self._open()
            return self._pool

    def _open(self) -> SessionPool | None:
        factory = self._factory
        if factory is None:
            ok, reason = nvcodec.nvdec_available() if self.device.type == "cuda" else (False, "not a CUDA device")
            if not ok:
                self._give_up(reason)
                return None
            factory = NvdecSessions(nvcodec.import_nvc())
        nvc = getattr(factory, "nvc", None)
        caps = decoder_caps(self.device, nvc)
        if caps.get("supported") is False:
            self._give_up("this GPU's NVDEC does not decode HEVC 4:4:4 8-bit (GetDecoderCaps)")
            return None
        self.sessions = min(self._size or int(caps["engines"]), max(1, self.threads))
        return SessionPool(lambda: factory(self.device), self.sessions)

    def disable(self, reason: str) -> None:
        """NVDEC failed in a way no later object will avoid (no decoder can be created): the CPU from now on."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            if self.unavailable is None:
                self._give_up(reason)

    def _give_up(self, reason: str) -> None:
        self.unavailable = reason
        logger.info("kvcodec: NVDEC unavailable (%s); video chunks decode on the CPU and are copied over", reason)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()


__all__ = ["NvdecDecoders", "NvdecSession", "NvdecSessions", "PlanesSession", "SessionPool", "chroma_444",
           "decoder_caps", "nvdec_engines"]


def nvdec_decode_planes(
    stream: bytes | memoryview, width: int, height: int, frames: int, device: torch.device | str = "cuda",
    *, packet_sizes: tuple[int, ...] | list[int] | None = None, session: Any | None = None,
) -> torch.Tensor:
    """Decode the ``video`` codec's HEVC Annex B stream with NVDEC: ``[frames, 3, height, width]`` uint8 on GPU.

    ``session``: an :class:`~vllm_kvcodec.gpu.nvdec_sessions.NvdecSession`
    to reuse (for pictures of this one size), or a
    :class:`~vllm_kvcodec.gpu.nvdec_sessions.SessionPool` to take one of this
    size from; without either, a decoder is created for this call only. ``packet_sizes``: the
    payload's packet table; without it the stream is cut into access units
    (:func:`~vllm_kvcodec.gpu.nvcodec.access_units`). Raises
    :class:`~vllm_kvcodec.gpu.nvcodec.NvCodecUnavailable` when PyNvVideoCodec/NVDEC cannot be used,
    :class:`CodecError` when the stream does not decode to exactly ``frames``
    4:4:4 pictures of the given size.
    """
    device = torch.device(device)
    if session is None:
        nvcodec.import_nvc()
        if device.type != "cuda" or not torch.cuda.is_available():
            raise nvcodec.NvCodecUnavailable(f"NVDEC decodes into CUDA memory; {device} is not a usable CUDA device")
    data = bytes(stream)
    if not data.startswith(nvcodec.ANNEXB_START) and not data.startswith(nvcodec.ANNEXB_START[1:]):
        raise CodecError("not an Annex B elementary stream (no start code)")
    packets = nvcodec.split_packets(data, packet_sizes) if packet_sizes is not None else nvcodec.access_units(data)
    if len(packets) != frames:
        raise CodecError(f"{len(packets)} packets for {frames} pictures")
    out = torch.empty((frames, nvcodec.PLANES, height, width), dtype=torch.uint8, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if hasattr(session, "take"):
            with session.take((width, height)) as decoder:
                decoder.decode_into(packets, width, height, out)
        else:
            (session if session is not None else NvdecSession(device)).decode_into(packets, width, height, out)
    return out
