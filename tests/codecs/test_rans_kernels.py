"""The rANS decoder (four lanes in registers) against the stream the encoder wrote: every length mod 4, skewed
tables, and streams cut short, padded or carrying a bad table refused."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from vllm_kvcodec.codecs import rans_kernels as rk


def stream(n: int, alphabet: int, skew: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = np.exp(-skew * np.arange(alphabet))
    symbols = rng.choice(alphabet, size=n, p=p / p.sum()).astype(np.uint8)
    freqs = rk.quantize_frequencies(np.bincount(symbols, minlength=256))
    if n == 0:
        freqs[0] = rk.PROB_SCALE
    return symbols, freqs, rk.encode_symbols(symbols, freqs)


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 3000), alphabet=st.integers(1, 256), skew=st.floats(0, 3), seed=st.integers(0, 2**32 - 1))
def test_decode_inverts_encode(n: int, alphabet: int, skew: float, seed: int) -> None:
    symbols, freqs, words = stream(n, alphabet, skew, seed)
    out = np.empty(n, dtype=np.uint8)
    assert rk.decode(words, freqs, out)
    assert np.array_equal(out, symbols)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_cut_or_padded_streams_are_refused(n: int, seed: int) -> None:
    symbols, freqs, words = stream(n, 40, 0.3, seed)
    out = np.empty(n, dtype=np.uint8)
    assert not rk.decode(np.append(words, np.uint16(7)), freqs, out)
    if words.size > 2 * rk.LANES:  # a stream of states alone has no word to cut
        assert not rk.decode(words[:-1], freqs, out)
    assert not rk.decode(words[: 2 * rk.LANES - 1], freqs, out)


def test_a_table_not_summing_to_the_scale_is_refused() -> None:
    symbols, freqs, words = stream(500, 10, 0.5, 1)
    out = np.empty(500, dtype=np.uint8)
    over = freqs.copy()
    over[0] += 1
    assert not rk.decode(words, over, out)
    under = freqs.copy()
    under[np.flatnonzero(under)[0]] -= 1
    assert not rk.decode(words, under, out)
