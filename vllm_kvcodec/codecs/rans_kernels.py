"""Numba kernels of a static, 4-way interleaved rANS coder (32-bit states, 16-bit words).

Why hand-written: the Python entropy-coding libraries measured here either
decode too slowly for a fetch path (constriction's categorical ANS: 83 MB/s of
KV) or offer no order-0 coder with a table we control (zstd, brotli). This is
the textbook rANS of Duda / Giesen's ryg_rans: 12-bit probabilities, states in
[2**16, 2**32), four states interleaved so the decoder's dependency chains
overlap. Every read is bounds-checked; a stream that ends early, has bytes
left over, or does not return the states to their initial value is rejected.
"""

from __future__ import annotations

import vllm_kvcodec.numba_compat  # noqa: F401  (before numba; see its docstring)
import numba
import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
LANES = 4


def quantize_frequencies(counts: np.ndarray) -> np.ndarray:
    """Scale symbol counts to sum to PROB_SCALE, keeping every present symbol >= 1."""
    counts = counts.astype(np.int64)
    total = int(counts.sum())
    freqs = np.zeros(counts.shape, dtype=np.int64)
    present = counts > 0
    if total == 0:
        return freqs.astype(np.uint16)
    freqs[present] = np.maximum(1, (counts[present] * PROB_SCALE) // total)
    # Hand the rounding difference to (or take it from) the most frequent symbols.
    diff = PROB_SCALE - int(freqs.sum())
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:
        s = order[i % int(present.sum())]
        if diff > 0:
            freqs[s] += 1
            diff -= 1
        elif freqs[s] > 1:
            freqs[s] -= 1
            diff += 1
        i += 1
    return freqs.astype(np.uint16)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def encode(symbols: np.ndarray, freqs: np.ndarray, out: np.ndarray) -> int:
    """Encode ``symbols`` (uint8) backwards into the tail of ``out`` (uint16).

    Returns the index in ``out`` where the words start; the four final states
    are written to out[0:8] as little-endian 16-bit halves. ``out`` must hold
    8 + 2 * len(symbols) + 8 words (the worst case).
    """
    starts = np.zeros(256, dtype=np.uint32)
    acc = np.uint32(0)
    for s in range(256):
        starts[s] = acc
        acc += np.uint32(freqs[s])
    state = np.full(LANES, RANS_L, dtype=np.uint32)
    pos = out.shape[0]
    for i in range(symbols.shape[0] - 1, -1, -1):
        lane = i & (LANES - 1)
        s = symbols[i]
        f = np.uint32(freqs[s])
        x = state[lane]
        x_max = f << np.uint32(32 - PROB_BITS)  # ((RANS_L >> PROB_BITS) << 16) * f
        if x >= x_max:
            pos -= 1
            out[pos] = np.uint16(x & np.uint32(0xFFFF))
            x = x >> np.uint32(16)
        state[lane] = ((x // f) << np.uint32(PROB_BITS)) + (x % f) + starts[s]
    for lane in range(LANES):
        out[2 * lane] = np.uint16(state[lane] & np.uint32(0xFFFF))
        out[2 * lane + 1] = np.uint16(state[lane] >> np.uint32(16))
    return pos


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode_tables(freqs: np.ndarray) -> tuple:
    """Slot -> symbol table plus per-symbol starts (freqs must already sum to PROB_SCALE)."""
    starts = np.zeros(256, dtype=np.uint32)
    slot_sym = np.zeros(PROB_SCALE, dtype=np.uint8)
    acc = 0
    for s in range(256):
        starts[s] = acc
        for j in range(acc, acc + np.int64(freqs[s])):
            slot_sym[j] = s
        acc += np.int64(freqs[s])
    return starts, slot_sym


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode(words: np.ndarray, freqs: np.ndarray, out: np.ndarray) -> bool:
    """Decode len(out) symbols; False on any inconsistency (the caller raises)."""
    if words.shape[0] < 2 * LANES:
        return False
    starts, slot_sym = decode_tables(freqs)
    f32 = freqs.astype(np.uint32)
    state = np.empty(LANES, dtype=np.uint32)
    for lane in range(LANES):
        state[lane] = np.uint32(words[2 * lane]) | (np.uint32(words[2 * lane + 1]) << np.uint32(16))
        if state[lane] < RANS_L:
            return False
    pos = 2 * LANES
    n_words = words.shape[0]
    mask = np.uint32(PROB_SCALE - 1)
    for i in range(out.shape[0]):
        lane = i & (LANES - 1)
        x = state[lane]
        slot = x & mask
        s = slot_sym[slot]
        x = f32[s] * (x >> np.uint32(PROB_BITS)) + slot - starts[s]
        if x < RANS_L:
            if pos >= n_words:
                return False
            x = (x << np.uint32(16)) | np.uint32(words[pos])
            pos += 1
        state[lane] = x
        out[i] = s
    for lane in range(LANES):
        if state[lane] != RANS_L:
            return False
    return pos == n_words


def encode_symbols(symbols: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """The complete word stream (4 states, then the renormalisation words)."""
    out = np.empty(4 * LANES + symbols.shape[0], dtype=np.uint16)
    pos = encode(symbols, freqs, out)
    return np.concatenate([out[: 2 * LANES], out[pos:]])
