"""KVCodec's layout claim, put to the test: what codes a lossy level's integers best, rANS or a video codec?

KVCodec (arXiv 2602.09725) quantises KV to 8 bits and codes the integers with
lossless HEVC, and credits its frame layout (one token per frame, three
adjacent layers in the three 4:4:4 planes, each layer's ``[heads, dim]``
tiled into the picture) with most of its ratio. This benchmark codes the very
integers the ``quantized`` codec stores (:meth:`QuantizedCodec.unpack` of its
payload, real SmolLM2 KV in 256-token chunks) with each candidate, checks each
round trip bit-exact on the integers, and reports bits per value, the whole
chunk's ratio against bf16 (scales, kept values and header as the codec stores
them), and encode/decode MB/s of bf16 input, one thread, median of repeats.

The integer stage is timed alone (it is all the candidates differ in); the
chunk figures add the quantisation and dequantisation every candidate shares,
measured as ``encode_chunk``/``decode_chunk`` minus the rANS stage inside them.
"""

from __future__ import annotations

import dataclasses
import statistics
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_kvcodec.codecs import get_codec, video_av
from vllm_kvcodec.codecs.precision import LOSSY_LABEL
from vllm_kvcodec.codecs.rans import encode_plane, read_plane
from vllm_kvcodec.codecs.validate import Reader
from vllm_kvcodec.codecs.video_layout import ALIGN, MIN_SIDE, PLANES, geometry, from_planes, to_planes
from vllm_kvcodec.format import decode_chunk, encode_chunk, payload_of, read_header
from vllm_kvcodec.tools.bench.report import console, machine, wide_table, write_json

CHUNK_TOKENS = 256
#: The links KVCodec measures over (1 to 40 Gbit/s; its anchor is 16): the winner loads fastest on the slowest.
LINKS_GBPS = (1, 16, 40)
#: What a video candidate stores beside its packets, as the ``video`` codec does: width, height, frames (and a
#: size per packet).
_VIDEO_HEAD = struct.Struct("<HHI")


@dataclasses.dataclass
class Chunk:
    """One quantised chunk: its integers ``[Lq, 2 (K, V), Tq, heads, dim]``, its bf16 size, and the bytes of the
    stored chunk that are not the integers (header, scales, kept values)."""

    q: np.ndarray
    bf16_bytes: int
    other_bytes: int


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A way to store the integers: ``encode`` returns the stored parts, ``decode`` the integers from them."""

    name: str
    what: str
    encode: Callable[[np.ndarray], list[bytes]]
    decode: Callable[[list[bytes], tuple[int, ...]], np.ndarray]
    side_bytes: Callable[[list[bytes]], int] = lambda parts: 0


def quantised_chunks(kv: torch.Tensor, precision: str, chunk_tokens: int = CHUNK_TOKENS) -> list[Chunk]:
    """The integers ``encode_chunk(chunk, precision=...)`` stores, read back through the codec's own ``unpack``."""
    chunks = []
    for c in kv.split(chunk_tokens, dim=2):
        c = c.contiguous()
        blob = encode_chunk(c, precision=precision)
        header = read_header(blob)
        parts = get_codec(header.codec_config).unpack(payload_of(blob, header), header.dtype, header.shape)
        planes = sum(len(encode_plane(p.reshape(-1))) for p in (parts.keys, parts.values))  # as stored (deterministic)
        chunks.append(Chunk(np.stack([parts.keys, parts.values], axis=1), c.numel() * c.element_size(),
                            len(blob) - planes))
    return chunks


# ---- candidates -----------------------------------------------------------------------------------------------
def _rans_decode(parts: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape[2:])) * shape[0]
    planes = []
    for part in parts:
        reader = Reader(memoryview(part), "rans plane")
        planes.append(read_plane(reader, n))
        reader.finish()
    lq, _, tq, heads, dim = shape
    return np.stack([p.reshape(lq, tq, heads, dim) for p in planes], axis=1)


RANS = Candidate("rans", "order-0 rANS per plane (keys, values): the quantized codec today",
                 lambda q: [encode_plane(q[:, 0].reshape(-1)), encode_plane(q[:, 1].reshape(-1))], _rans_decode)


def paper_frames(q: np.ndarray, min_side: int) -> np.ndarray:
    """KVCodec's layout: one 4:4:4 picture per token; plane ``p`` of picture ``t`` holds layers ``3g + p``, their
    ``[heads, dim]`` tiles stacked (layer group, then K/V) into ``groups * 2 * heads`` rows of ``dim``. Both sides
    rounded up to 8 and to ``min_side``; padding repeats the last row and column (the layers past the last whole
    group repeat the last layer)."""
    lq, _, tq, heads, dim = q.shape
    groups = -(-lq // PLANES)
    x = np.concatenate([q, np.repeat(q[-1:], groups * PLANES - lq, axis=0)]) if lq % PLANES else q
    x = x.reshape(groups, PLANES, 2, tq, heads, dim).transpose(3, 1, 0, 2, 4, 5).reshape(tq, PLANES, -1, dim)
    height, width = paper_size(q.shape, min_side)
    return np.pad(x, ((0, 0), (0, 0), (0, height - x.shape[2]), (0, width - dim)), mode="edge")


def paper_size(shape: tuple[int, ...], min_side: int) -> tuple[int, int]:
    """(height, width) of :func:`paper_frames`' pictures for integers of ``shape``."""
    lq, _, _, heads, dim = shape
    rows = -(-lq // PLANES) * 2 * heads
    return max(min_side, -(-rows // ALIGN) * ALIGN), max(min_side, -(-dim // ALIGN) * ALIGN)


def paper_integers(frames: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`paper_frames`: crop, and put the tiles back as ``[Lq, 2, Tq, heads, dim]``."""
    lq, _, tq, heads, dim = shape
    groups = -(-lq // PLANES)
    x = frames[:, :, : groups * 2 * heads, :dim].reshape(tq, PLANES, groups, 2, heads, dim)
    return np.ascontiguousarray(x.transpose(2, 1, 3, 0, 4, 5).reshape(groups * PLANES, 2, tq, heads, dim)[:lq])


def _video(name: str, what: str, backend: str, layout: str, min_side: int = MIN_SIDE,
           preset: str | None = None) -> Candidate:
    """A video candidate: ``layout`` "paper" (token = frame, P pictures after one IDR per chunk) or "naive" (the
    lossless ``video`` codec's layout 1 on the integers, all intra, as that codec stores exponents)."""

    def frames_of(q: np.ndarray) -> np.ndarray:
        return paper_frames(q, min_side) if layout == "paper" else to_planes(q, geometry(q.shape))

    def encode(q: np.ndarray) -> list[bytes]:
        frames = frames_of(q)
        gop = frames.shape[0] if layout == "paper" else None
        return video_av.encode_pictures(frames, backend, preset, 1, gop=gop)

    def decode(parts: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
        if layout == "paper":
            height, width = paper_size(shape, min_side)
            frames = video_av.decode_pictures([memoryview(p) for p in parts], backend, width, height)
            return paper_integers(frames, shape)
        geo = geometry(shape)
        frames = video_av.decode_pictures([memoryview(p) for p in parts], backend, geo.width, geo.height)
        return from_planes(frames, geo).reshape(shape)

    return Candidate(name, what, encode, decode, lambda parts: _VIDEO_HEAD.size + 4 * len(parts))


def candidates() -> list[Candidate]:
    tight = ALIGN  # the smallest picture x265 codes without a conformance window: the layout's own size
    return [
        RANS,
        _video("hevc paper", "HEVC lossless, KVCodec's layout, pictures at their own size (CPU decode only)",
               "hevc", "paper", min_side=tight),
        _video("hevc paper 144", "the same, pictures padded to 144 x 144 (NVDEC's minimum)", "hevc", "paper"),
        _video("hevc paper medium", "KVCodec's layout, x265 preset medium (more motion search)", "hevc", "paper",
               min_side=tight, preset="medium"),
        _video("hevc naive", "HEVC lossless, the video codec's layout 1 (rows = tokens of one layer's K or V), "
               "all intra", "hevc", "naive"),
        _video("ffv1 naive", "FFV1, the video codec's layout 1", "ffv1", "naive"),
        _video("ffv1 paper", "FFV1, KVCodec's layout (one context state over the chunk)", "ffv1", "paper",
               min_side=tight),
    ]


def pick(names: tuple[str, ...] | None) -> list[Candidate]:
    """The candidates named (all for None), in :func:`candidates`' order; ValueError for a name it does not know."""
    known = candidates()
    if unknown := sorted(set(names or ()) - {c.name for c in known}):
        raise ValueError(f"unknown layout candidate {unknown[0]!r}; known: {', '.join(c.name for c in known)}")
    return [c for c in known if names is None or c.name in names]


# ---- measurement -----------------------------------------------------------------------------------------------
def run(output: Path | None = None, precisions: tuple[str, ...] = ("int8",), tokens: int = 1024, repeats: int = 3,
        names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Measure every candidate (or those ``names``) at each precision level; print a table per level, write JSON."""
    from vllm_kvcodec.codecs.policy import DEFAULT_LOSSY_ENTROPY
    from vllm_kvcodec.tools.smollm2 import real_kv

    torch.set_num_threads(1)
    picked = pick(names)
    with console.status("building real SmolLM2 KV (cached after the first run)"):
        kv = real_kv(tokens)
    levels = {}
    for level in precisions:
        with console.status(f"measuring {level}"):
            levels[level] = _measure_level(kv, level, picked, repeats)
        _print(level, levels[level])
    result = {"benchmark": "layouts", "machine": machine(), "label": LOSSY_LABEL, "threads": 1, "tokens": tokens,
              "chunk_tokens": CHUNK_TOKENS, "chunk_shape": list(kv[:, :, :CHUNK_TOKENS].shape), "repeats": repeats,
              "statistic": "median", "default_entropy": DEFAULT_LOSSY_ENTROPY, "precisions": levels,
              "winner": {level: r["winner"] for level, r in levels.items()}}
    write_json(result, output)
    return result


def _measure_level(kv: torch.Tensor, level: str, picked: list[Candidate], repeats: int) -> dict[str, Any]:
    chunks = quantised_chunks(kv, level)
    bf16 = sum(c.bf16_bytes for c in chunks)
    stored = {c.name: [c.encode(ch.q) for ch in chunks] for c in picked}  # also the warm-up
    exact = {c.name: all(np.array_equal(c.decode(parts, ch.q.shape), ch.q)
                         for parts, ch in zip(stored[c.name], chunks)) for c in picked}
    times: dict[str, tuple[list[float], list[float]]] = {c.name: ([], []) for c in picked}
    for _ in range(repeats):  # candidates interleaved, so a change in the machine's load spreads over all of them
        for c in picked:
            times[c.name][0].append(_timed(lambda: [c.encode(ch.q) for ch in chunks]))
            times[c.name][1].append(_timed(lambda: [c.decode(p, ch.q.shape) for p, ch in zip(stored[c.name], chunks)]))
    shared = _shared_seconds(kv, [ch.q for ch in chunks], level, repeats)
    integers = sum(ch.q.size for ch in chunks)
    rows = []
    for c in picked:
        size = sum(sum(map(len, parts)) + c.side_bytes(parts) for parts in stored[c.name])
        enc, dec = (statistics.median(t) for t in times[c.name])
        rows.append({"name": c.name, "what": c.what, "bytes": size, "bits_per_value": 8 * size / integers,
                     "ratio": bf16 / (sum(ch.other_bytes for ch in chunks) + size),
                     "encode_MBps": bf16 / enc / 1e6, "decode_MBps": bf16 / dec / 1e6,
                     "chunk_encode_MBps": bf16 / (shared["encode_s"] + enc) / 1e6,
                     "chunk_decode_MBps": bf16 / (shared["decode_s"] + dec) / 1e6,
                     "bit_exact": exact[c.name], "encode_s": times[c.name][0], "decode_s": times[c.name][1]})
    _add_load_times(rows)
    good = [r for r in rows if r["bit_exact"]]
    slowest = str(LINKS_GBPS[0])
    return {"chunks": len(chunks), "integers": integers, "bf16_bytes": bf16, "shared": shared,
            "entropy_bits": entropy_bits(chunks), "results": rows,
            "densest": max(good, key=lambda r: r["ratio"])["name"] if good else None,
            "winner": min(good, key=lambda r: r["load_s_per_GB"][slowest])["name"] if good else None}


def _add_load_times(rows: list[dict[str, Any]]) -> None:
    """Seconds to fetch and decode (one thread) a GB of bf16 KV at each of :data:`LINKS_GBPS`, and for a candidate
    denser than rANS but slower to decode, the link speed below which it would still load faster."""
    for r in rows:
        r["load_s_per_GB"] = {str(g): 8 / r["ratio"] / g + 1e3 / r["chunk_decode_MBps"] for g in LINKS_GBPS}
    rans = next((r for r in rows if r["name"] == RANS.name), None)
    for r in rows:
        smaller = rans is not None and r["ratio"] > rans["ratio"] and r["chunk_decode_MBps"] < rans["chunk_decode_MBps"]
        r["faster_than_rans_below_Mbps"] = (
            8 * (1 / rans["ratio"] - 1 / r["ratio"]) / (1 / r["chunk_decode_MBps"] - 1 / rans["chunk_decode_MBps"])
            if smaller else None)


def _shared_seconds(kv: torch.Tensor, q: list[np.ndarray], level: str, repeats: int) -> dict[str, float]:
    """Quantisation and dequantisation (with scales, kept values, framing), which every candidate pays: the whole
    ``encode_chunk``/``decode_chunk`` less the two rANS planes (of the integers ``q``) inside it, timed back to
    back and the median of the differences taken, so that a change in the machine's load falls on both."""
    chunks = [c.contiguous() for c in kv.split(CHUNK_TOKENS, dim=2)]
    blobs = [encode_chunk(c, precision=level) for c in chunks]
    planes = [RANS.encode(x) for x in q]
    encode, decode = [], []
    for _ in range(repeats):
        encode.append(_timed(lambda: [encode_chunk(c, precision=level) for c in chunks])
                      - _timed(lambda: [RANS.encode(x) for x in q]))
        decode.append(_timed(lambda: [decode_chunk(b) for b in blobs])
                      - _timed(lambda: [RANS.decode(p, x.shape) for p, x in zip(planes, q)]))
    return {"encode_s": max(0.0, statistics.median(encode)), "decode_s": max(0.0, statistics.median(decode))}


def entropy_bits(chunks: list[Chunk]) -> dict[str, float]:
    """Order-0 entropy per value of the integers, of their token-to-token differences (what inter prediction
    could remove) and of their differences between adjacent layers (what KVCodec's planes put side by side): the
    mean over chunks and over keys and values."""
    out: dict[str, list[float]] = {"order0": [], "token_delta": [], "layer_delta": []}
    for ch in chunks:
        for plane in (ch.q[:, 0].astype(np.int16), ch.q[:, 1].astype(np.int16)):
            out["order0"].append(_entropy(plane))
            out["token_delta"].append(_entropy(np.diff(plane, axis=1)))
            if plane.shape[0] > 1:
                out["layer_delta"].append(_entropy(np.diff(plane, axis=0)))
    return {k: float(np.mean(v)) if v else float("nan") for k, v in out.items()}


def _entropy(x: np.ndarray) -> float:
    counts = np.bincount((x.reshape(-1).astype(np.int32) + 255))
    p = counts[counts > 0] / x.size
    return float(-(p * np.log2(p)).sum())


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _print(level: str, measured: dict[str, Any]) -> None:
    e = measured["entropy_bits"]
    wide_table(f"{level} ({LOSSY_LABEL}): its integers coded losslessly, {measured['chunks']} real SmolLM2 chunks "
               f"of {CHUNK_TOKENS} tokens, 1 thread, median MB/s of bf16 input",
               ["candidate", "bits/value", "ratio", "int enc MB/s", "int dec MB/s", "chunk enc MB/s",
                "chunk dec MB/s", f"load s/GB {LINKS_GBPS[0]}G", "exact"],
               [[r["name"], f"{r['bits_per_value']:.3f}", f"{r['ratio']:.3f}", *(f"{r[k]:.1f}" for k in (
                   "encode_MBps", "decode_MBps", "chunk_encode_MBps", "chunk_decode_MBps")),
                 f"{r['load_s_per_GB'][str(LINKS_GBPS[0])]:.1f}", "yes" if r["bit_exact"] else "NO"]
                for r in measured["results"]], width=140)
    console.print(f"order-0 entropy {e['order0']:.2f} bits, token-to-token differences {e['token_delta']:.2f}, "
                  f"adjacent-layer differences {e['layer_delta']:.2f}; densest bit-exact: {measured['densest']}; "
                  f"fastest load at {LINKS_GBPS[0]} Gbit/s: {measured['winner']}")
