"""Compile the codecs' kernels at start-up, so the first load of a fresh process does not pay for it.

The rans and splitzip kernels are numba functions, compiled on their first
call (seconds) unless numba's on-disk cache already holds them (next to the
source, or in the user's cache directory when the install is read-only),
which it does not in a new container. Paid inside the first request, that is
a first remote hit several times slower than the next one. So the worker half
runs one tiny encode and decode of every codec that can hold the engine's
dtype while the engine starts; numba caches what it compiled, so the next
process only loads it.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("vllm_kvcodec")


def warm_up(dtype: torch.dtype) -> dict[str, float]:
    """Encode and decode a small sample with every codec that holds ``dtype``; seconds per codec."""
    from vllm_kvcodec.codecs import codec_ids, get_codec
    from vllm_kvcodec.codecs.dtypes import DType
    from vllm_kvcodec.errors import ConfigError
    from vllm_kvcodec.format import decode_chunk, encode_chunk

    wire = DType.from_torch(dtype)
    values = torch.randn((2, 2, 32, 2, 64), generator=torch.Generator().manual_seed(0)) * 0.5
    flat = values.view(-1)
    flat[::5] = torch.logspace(-30, 30, flat[::5].numel())  # rare exponents: splitzip's escape kernels run too
    sample = values.to(dtype)
    seconds: dict[str, float] = {}
    for codec_id in codec_ids():
        try:
            codec = get_codec(codec_id)
        except ConfigError as exc:  # an installed plug-in that does not import: it is refused where it is named
            logger.warning("kvcodec: codec %s not warmed up: %s", codec_id, exc)
            continue
        # video: libav, no JIT and its own start-up; a lossy codec: only a precision level stores with it, and its
        # kernels are rans's, warmed here anyway.
        if not codec.supports(wire) or codec_id == "video" or not codec.lossless:
            continue
        t0 = time.perf_counter()
        blob = encode_chunk(sample, codec)
        decode_chunk(blob)
        _decode_into_pages(blob)
        seconds[codec_id] = time.perf_counter() - t0
    logger.info("kvcodec: codec kernels ready in %.2f s (%s)", sum(seconds.values()),
                ", ".join(f"{c} {s:.2f} s" for c, s in seconds.items()))
    return seconds


def _decode_into_pages(blob: bytes) -> None:
    """The decode a page object landing whole takes (straight into its pages): here into two halves of a buffer."""
    from vllm_kvcodec.codecs.into_pages import PageExtents
    from vllm_kvcodec.format import decode_payload_into, read_header

    header = read_header(blob)
    pages = memoryview(bytearray(header.raw_nbytes))
    half = header.raw_nbytes // 2 // 4 * 4
    decode_payload_into(blob, header, PageExtents([pages[:half], pages[half:]]))
