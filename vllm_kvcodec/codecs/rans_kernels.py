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

import vllm_kvcodec.codecs.numba_compat  # noqa: F401  (before numba; see its docstring)
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
def slot_table(freqs: np.ndarray) -> np.ndarray:
    """Per 12-bit slot: ``symbol << 24 | (frequency - 1) << 12 | slot - start``, one load per decoded symbol.

    ``freqs`` must sum to PROB_SCALE (the caller checks; a table is never written past its end).
    """
    table = np.zeros(PROB_SCALE, dtype=np.uint32)
    acc = 0
    for s in range(256):
        f = np.int64(freqs[s])
        for j in range(min(f, PROB_SCALE - acc)):
            table[acc + j] = (np.uint32(s) << np.uint32(24)) | (np.uint32(f - 1) << np.uint32(12)) | np.uint32(j)
        acc += f
    return table


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _step(x: np.uint32, table: np.ndarray) -> tuple:
    e = table[x & np.uint32(PROB_SCALE - 1)]
    x = (((e >> np.uint32(12)) & np.uint32(0xFFF)) + np.uint32(1)) * (x >> np.uint32(PROB_BITS)) + (e & np.uint32(0xFFF))
    return x, np.uint8(e >> np.uint32(24))


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _renorm(x: np.uint32, buf: np.ndarray, pos: int) -> tuple:
    """Shift in the next word when the state fell below RANS_L (the caller checks ``pos``).

    Branch-free: whether a state needs a word is a coin toss the predictor
    loses, so the word is always read (the caller leaves one there) and selected.
    """
    need = x < np.uint32(RANS_L)
    shifted = (x << np.uint32(16)) | np.uint32(buf[pos])
    return (shifted if need else x), pos + np.int64(need)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode(words: np.ndarray, freqs: np.ndarray, out: np.ndarray) -> bool:
    """Decode len(out) symbols from ``words`` (uint16, as stored); False on any inconsistency (the caller raises).

    The four lanes' states live in registers, one symbol of each per round:
    their chains overlap (2.3 ns a symbol against 3.4 with the states in an
    array, on real KV). Rounds read without a bounds check while a whole
    round's four words are left (renormalisation reads its word always and
    selects it: see _renorm); the last rounds check every read. The stream is
    read where it lies: no widened, padded copy of it.
    """
    n_words = words.shape[0]
    if n_words < 2 * LANES:
        return False
    total = 0
    for s in range(256):
        total += np.int64(freqs[s])
    if total != PROB_SCALE:
        return False
    table = slot_table(freqs)
    low = np.uint32(RANS_L)
    s16 = np.uint32(16)
    x0 = np.uint32(words[0]) | (np.uint32(words[1]) << s16)
    x1 = np.uint32(words[2]) | (np.uint32(words[3]) << s16)
    x2 = np.uint32(words[4]) | (np.uint32(words[5]) << s16)
    x3 = np.uint32(words[6]) | (np.uint32(words[7]) << s16)
    if x0 < low or x1 < low or x2 < low or x3 < low:
        return False
    pos = 2 * LANES
    n = out.shape[0]
    rounds = n - (n & (LANES - 1))
    i = 0
    while i < rounds and pos + LANES <= n_words:
        x0, out[i] = _step(x0, table)
        x0, pos = _renorm(x0, words, pos)
        x1, out[i + 1] = _step(x1, table)
        x1, pos = _renorm(x1, words, pos)
        x2, out[i + 2] = _step(x2, table)
        x2, pos = _renorm(x2, words, pos)
        x3, out[i + 3] = _step(x3, table)
        x3, pos = _renorm(x3, words, pos)
        i += LANES
    states = np.empty(LANES, dtype=np.uint32)
    states[0], states[1], states[2], states[3] = x0, x1, x2, x3
    for j in range(i, n):  # the last rounds, and lanes 0..2 of a partial one: every read checked
        x, out[j] = _step(states[j & (LANES - 1)], table)
        if x < low:
            if pos >= n_words:
                return False
            x = (x << s16) | np.uint32(words[pos])
            pos += 1
        states[j & (LANES - 1)] = x
    return pos == n_words and states[0] == low and states[1] == low and states[2] == low and states[3] == low


def encode_symbols(symbols: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """The complete word stream (4 states, then the renormalisation words)."""
    out = np.empty(4 * LANES + symbols.shape[0], dtype=np.uint16)
    pos = encode(symbols, freqs, out)
    return np.concatenate([out[: 2 * LANES], out[pos:]])
