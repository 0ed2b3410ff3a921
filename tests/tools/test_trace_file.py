"""The trace reader: every line checked (a bad one named by its line number), and the prompts vLLM's client makes."""

from __future__ import annotations

import json
import random

import pytest

from vllm_kvcodec.tools.bench.trace_file import (
    DEFAULT_TRACE,
    TraceError,
    TraceRequest,
    ceiling_tokens,
    pieces,
    prompt_length,
    read_trace,
    write_trace,
)

GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]}


def lines(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_a_good_file_reads_in_order_with_indexes(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    lines(p, [GOOD, {**GOOD, "timestamp": 5, "hash_ids": [0, 3]}, "", {**GOOD, "timestamp": 9.5}])
    rows = read_trace(p)
    assert [r.index for r in rows] == [0, 1, 2]
    assert [r.timestamp_ms for r in rows] == [0, 5, 9.5]
    assert rows[1].hash_ids == (0, 3)
    assert len(read_trace(p, first=2)) == 2
    assert len(read_trace(p, window_s=0.006)) == 2  # 5 ms in, 9.5 ms out


@pytest.mark.parametrize("bad, says", [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1}, "missing hash_ids"),
    ({**GOOD, "timestamp": -1}, "timestamp must be a number >= 0"),
    ({**GOOD, "timestamp": "0"}, "timestamp must be a number"),
    ({**GOOD, "input_length": 0}, "input_length must be an integer >= 1"),
    ({**GOOD, "input_length": 1.5}, "input_length must be an integer"),
    ({**GOOD, "output_length": True}, "output_length must be an integer"),
    ({**GOOD, "hash_ids": []}, "hash_ids must be a non-empty list"),
    ({**GOOD, "hash_ids": [0, -1]}, "hash_ids must be a non-empty list of integers >= 0"),
    ({**GOOD, "hash_ids": "012"}, "hash_ids must be a non-empty list"),
])
def test_a_malformed_line_is_refused_with_its_line_number(tmp_path, bad, says) -> None:
    p = tmp_path / "t.jsonl"
    lines(p, [GOOD, {**GOOD, "timestamp": 1}, bad, {**GOOD, "timestamp": 3}])
    with pytest.raises(TraceError) as err:
        read_trace(p)
    assert f"{p}:3:" in str(err.value) and says in str(err.value)


def test_arrivals_out_of_order_and_empty_files_are_refused(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    lines(p, [{**GOOD, "timestamp": 4}, {**GOOD, "timestamp": 2}])
    with pytest.raises(TraceError, match=r":2: timestamp 2 is before the previous line's 4"):
        read_trace(p)
    lines(p, [""])
    with pytest.raises(TraceError, match="no requests"):
        read_trace(p)
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.jsonl")


def test_pieces_are_what_vllms_timed_trace_client_makes() -> None:
    """vLLM's TimedTrace._expand_prompt, run on the same lines: piece sizes and total length agree."""
    from vllm.benchmarks.datasets.datasets import TimedTrace

    class Tok:  # the few tokenizer calls _expand_prompt makes
        all_special_ids: list[int] = []

        def get_vocab(self) -> dict[str, int]:
            return {str(i): i for i in range(1000)}

    rng = random.Random(7)
    for _ in range(50):
        ids = rng.randint(1, 6)
        r = TraceRequest(0, 0, rng.randint(1, 6 * 64 + 40), 1, tuple(range(ids)))
        for n in (16, 64):
            dataset = TimedTrace.__new__(TimedTrace)
            dataset.chunk_size, dataset._expanded_generated_prompts = n, {}
            tokens = dataset._expand_prompt(list(r.hash_ids), r.input_length, Tok())
            assert len(tokens) == prompt_length(r, n) == sum(s for _, s in pieces(r, n))
            keys = list(dataset._expanded_generated_prompts)  # "id:size" per piece, in order
            assert keys == [f"{h}:{s}" for h, s in pieces(r, n)][: len(keys)]


def test_the_ceiling_counts_leading_ids_seen_before() -> None:
    rows = [TraceRequest(0, 0, 1500, 1, (0, 1, 2)), TraceRequest(1, 1, 1200, 1, (0, 1, 5)),
            TraceRequest(2, 2, 700, 1, (9, 1)), TraceRequest(3, 3, 600, 1, (0, 1))]
    # 2: none (its 1 follows 9, another prefix); 3: both, capped at its 600 tokens
    assert ceiling_tokens(rows, 512) == [0, 1024, 0, 600]
    assert ceiling_tokens(rows, 32) == [0, 64, 0, 64]


def test_written_traces_read_back_with_answers_capped(tmp_path) -> None:
    rows = [TraceRequest(0, 0, 1500, 300, (0, 1, 2)), TraceRequest(1, 250.5, 900, 2, (0, 4))]
    back = read_trace(write_trace(rows, tmp_path / "w.jsonl", max_output=4))
    assert [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in back] == [
        (0, 1500, 4, (0, 1, 2)), (250.5, 900, 2, (0, 4))]


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"the Mooncake trace is not at {DEFAULT_TRACE} (data, not in git)")
def test_the_mooncake_trace_reads_whole_with_its_published_ceiling() -> None:
    rows = read_trace(DEFAULT_TRACE)
    assert len(rows) == 12031
    total = sum(prompt_length(r, 512) for r in rows)
    assert total == sum(r.input_length for r in rows) == 144_793_823
    assert round(sum(ceiling_tokens(rows, 512)) / total, 3) == 0.374  # the README's figure
