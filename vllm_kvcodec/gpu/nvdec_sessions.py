"""NVDEC decoder sessions for the load path: created once, reused for every ``video`` object, a few per GPU.

Creating an NVDEC decoder (``cuvidCreateDecoder`` plus PyNvVideoCodec's
set-up) takes milliseconds and device memory for its surfaces; a chunk's
stream decodes in far less. So a session is made once and fed stream after
stream: every ``video`` stream is all-intra, each picture an IDR with its
parameter sets in the first packet, so the next stream needs no reset. The
fetcher's threads share a :class:`SessionPool` sized to the GPU's NVDEC
engines (more sessions than engines only queue inside the driver), never
more than its fetch threads.

PyNvVideoCodec versions: ``vllm==0.33.0`` pins 2.0.4 and the latest is 2.2.4.
:class:`NvdecSession` uses only calls both offer (read from both wheels:
``CreateDecoder(gpuid, codec, cudacontext, cudastream, usedevicememory,
latency)``, a ``PacketData()`` whose ``bsl_data``/``bsl``/``decode_flag`` the
caller sets, ``VideoPacketFlag.ENDOFPICTURE``, ``DisplayDecodeLatencyType.ZERO``,
``cudaVideoCodec.HEVC``, ``GetDecoderCaps(...)["num_decoder_engines"]``,
frames through DLPack). Not used: ``GetLockedFrame``/``UnlockFrame`` (2.0.4
only), the demuxer (one per stream would be created per object; the payload
already holds each picture's packet size), ``SimpleDecoder`` (file/URL
sources, its own threads). The 2.0.4 wheel reports ``__version__ ==
"2.1.1"``, so nothing here branches on the version string.

Ordering: the decoder writes its pictures on the session's own CUDA stream.
After each ``Decode`` the caller's current stream (the load path's side
stream) waits for that stream and copies the pictures out; the session's
stream then waits for the copies before the next ``Decode`` may reuse the
decoder's surfaces. No host synchronisation.

:class:`LibavSession` decodes the same stream with libav on the CPU and
copies the pictures to the device: the stand-in the tests and the device
check's ``--dry-run`` use where there is no NVDEC. The product never picks
it: without NVDEC, ``video`` objects take the CPU codec's decode.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
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
    """One decoder, reused stream after stream."""

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


class NvdecSession:
    """A PyNvVideoCodec decoder on one device, with its own CUDA stream (see the module docstring)."""

    def __init__(self, device: torch.device, nvc: Any | None = None) -> None:
        self.nvc = nvc if nvc is not None else nvcodec._import_nvc()
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        try:
            self.decoder = self.nvc.CreateDecoder(
                gpuid=device.index or 0, codec=self.nvc.cudaVideoCodec.HEVC, cudacontext=0,
                cudastream=self.stream.cuda_stream if self.stream is not None else 0,
                usedevicememory=True, latency=self.nvc.DisplayDecodeLatencyType.ZERO)
        except Exception as exc:  # noqa: BLE001 - PyNvVCExceptionUnsupported and friends
            raise nvcodec.NvCodecUnavailable(f"CreateDecoder failed: {type(exc).__name__}: {exc}") from None
        self.streams_decoded = 0

    def decode_into(self, packets: list[memoryview], width: int, height: int, out: torch.Tensor) -> None:
        frames = len(packets)
        got = 0
        for data in packets:
            got = self._take(self._decode(data, self.nvc.VideoPacketFlag.ENDOFPICTURE), got, frames, width, height, out)
        if got != frames:
            raise CodecError(f"HEVC stream decoded to {got} pictures, expected {frames}")
        self.streams_decoded += 1

    def _decode(self, data: memoryview, flag: Any) -> list:
        buf = np.frombuffer(data, dtype=np.uint8)  # alive until Decode returns (the parser copies it)
        packet = self.nvc.PacketData()
        packet.bsl_data, packet.bsl, packet.decode_flag = buf.ctypes.data, buf.size, flag
        try:
            return list(self.decoder.Decode(packet))
        except Exception as exc:  # noqa: BLE001 - PyNvVCException* on a damaged stream
            raise CodecError(f"NVDEC could not decode the stream: {type(exc).__name__}: {exc}") from None

    def _take(self, decoded: list, got: int, frames: int, width: int, height: int, out: torch.Tensor) -> int:
        if not decoded:
            return got
        if got + len(decoded) > frames:
            raise CodecError(f"HEVC stream holds more than the {frames} pictures promised")
        if self.stream is not None:  # the pictures are written on the session's stream
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for frame in decoded:
            nvcodec._frame_planes(frame, width, height, self.device, out=out[got])
            got += 1
        if self.stream is not None:  # the next Decode may reuse those surfaces only after the copies
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return got

    def close(self) -> None:
        self.decoder = None


class LibavSession:
    """libav on the CPU in NVDEC's place, then one copy to the device: tests and dry runs only."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams_decoded = 0

    def decode_into(self, packets: list[memoryview], width: int, height: int, out: torch.Tensor) -> None:
        from vllm_kvcodec.codecs import video_av

        out.copy_(torch.from_numpy(video_av.decode_pictures(packets, "hevc", width, height)), non_blocking=False)
        self.streams_decoded += 1

    def close(self) -> None:
        pass


class SessionPool:
    """At most ``size`` sessions, made on first need and handed to one thread at a time.

    A session whose decode raised is closed and replaced on a later take: a
    damaged stream may leave a decoder's parser mid-picture.
    """

    def __init__(self, factory: Callable[[], PlanesSession], size: int) -> None:
        self.factory, self.size = factory, max(1, size)
        self._free: list[PlanesSession] = []
        self._cond = threading.Condition()
        self.live = 0  # sessions that exist now (free or taken)
        self.created = 0

    @contextmanager
    def take(self) -> Iterator[PlanesSession]:
        session = self._get()
        try:
            yield session
        except BaseException:
            self._drop(session)
            raise
        with self._cond:
            self._free.append(session)
            self._cond.notify()

    def _get(self) -> PlanesSession:
        with self._cond:
            while not self._free and self.live >= self.size:
                self._cond.wait()  # woken by a session put back, or dropped (then this thread makes one)
            if self._free:
                return self._free.pop()
            self.live += 1
        try:
            session = self.factory()
        except BaseException:
            with self._cond:
                self.live -= 1
                self._cond.notify()
            raise
        self.created += 1
        return session

    def _drop(self, session: PlanesSession) -> None:
        session.close()
        with self._cond:
            self.live -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            free, self._free = self._free, []
        for session in free:
            self._drop(session)


def nvdec_engines(device: torch.device, nvc: Any | None = None) -> int:
    """NVDEC engines of ``device``: PyNvVideoCodec's decoder caps, else the table, else 1."""
    try:
        nvc = nvc if nvc is not None else nvcodec._import_nvc()
        caps = nvc.GetDecoderCaps(gpuid=device.index or 0, codec=nvc.cudaVideoCodec.HEVC,
                                  chromaformat=nvc.cudaVideoChromaFormat.YUV444, bitdepth=8)
        engines = int(caps.get("num_decoder_engines", 0))
        if engines > 0:
            return engines
    except Exception:  # noqa: BLE001 - an older build, no driver: the table
        pass
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else ""
    for key in sorted(NVDEC_ENGINES, key=len, reverse=True):  # "H200" before "H20"
        if key in name:
            return NVDEC_ENGINES[key]
    return 1


class NvdecDecoders:
    """The load path's NVDEC: a session pool where NVDEC works here, else None (the CPU decodes; logged once)."""

    def __init__(self, device: torch.device, threads: int,
                 factory: Callable[[torch.device], PlanesSession] | None = None, size: int | None = None) -> None:
        self.device, self.threads = device, threads
        self._factory, self._size = factory, size
        self._pool: SessionPool | None = None
        self.unavailable: str | None = None
        self._lock = threading.Lock()

    def pool(self) -> SessionPool | None:
        with self._lock:
            if self._pool is None and self.unavailable is None:
                self._pool = self._open()
            return self._pool

    def _open(self) -> SessionPool | None:
        factory, size = self._factory, self._size
        if factory is None:
            ok, reason = nvcodec.nvdec_available() if self.device.type == "cuda" else (False, "not a CUDA device")
            if not ok:
                self._give_up(reason)
                return None
            factory = NvdecSession
            size = size or nvdec_engines(self.device)
        return SessionPool(lambda: factory(self.device), min(size or 1, max(1, self.threads)))

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


__all__ = ["LibavSession", "NvdecDecoders", "NvdecSession", "PlanesSession", "SessionPool", "nvdec_engines"]
