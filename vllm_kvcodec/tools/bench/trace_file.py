"""The Mooncake request trace format: reading it (each line checked), cutting it down, and the prompts a replay makes.

One JSON object a line, one request a line, in arrival order: ``timestamp``
(milliseconds from the start), ``input_length`` and ``output_length``
(tokens), ``hash_ids`` (one id per block of the prompt; equal leading ids
mean equal prefixes). A line that is not such an object is refused with its
line number, before anything is started.

vLLM's own client (``vllm bench serve --dataset-name timed_trace``,
``TimedTrace._expand_prompt``) turns a line into a prompt of *pieces*: each
id in turn gives ``tokens_per_id`` tokens, or what is left of
``input_length`` when that is less, until ``input_length`` is used up. The
tokens of a piece are drawn from a generator seeded by ``hash(f"{id}:{size}")``,
so a piece is known by its id *and* its size: a short last piece shares no
tokens with the full piece of the same id. :func:`pieces` reproduces that
split, which is what the simulator keys its blocks on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Tokens per id in the released Mooncake traces.
TRACE_TOKENS_PER_ID = 512
#: The trace's own path: beside the checkout, not in git (it is data).
DEFAULT_TRACE = (Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "traces"
                 / "mooncake_conversation_trace.jsonl").resolve()


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One line of a trace: when it arrives (ms), its prompt and answer lengths, its block ids."""

    index: int  # its position among the lines read (0-based); vLLM's client names it by this
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": self.timestamp_ms, "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})


def read_trace(path: Path | str, first: int | None = None, window_s: float | None = None) -> list[TraceRequest]:
    """The trace's requests, every line checked; ``first`` keeps the first N, ``window_s`` those arriving within it."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    out: list[TraceRequest] = []
    last = 0.0
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            request = _parse_line(line, len(out), f"{path}:{number}")
            if request.timestamp_ms < last:
                raise TraceError(f"{path}:{number}: timestamp {request.timestamp_ms:g} is before the previous "
                                 f"line's {last:g} (a trace is in arrival order)")
            last = request.timestamp_ms
            if window_s is not None and request.timestamp_ms > window_s * 1000.0:
                break
            out.append(request)
            if first is not None and len(out) >= first:
                break
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def _parse_line(line: str, index: int, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a line must be a JSON object, got {type(row).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ts, inp, outp, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    if not _number(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    if not _integer(inp) or inp < 1:
        raise TraceError(f"{where}: input_length must be an integer >= 1, got {inp!r}")
    if not _integer(outp) or outp < 1:
        raise TraceError(f"{where}: output_length must be an integer >= 1, got {outp!r}")
    if not isinstance(ids, list) or not ids or not all(_integer(h) and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a non-empty list of integers >= 0")
    return TraceRequest(index, float(ts), int(inp), int(outp), tuple(ids))


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v not in (float("inf"), float("-inf"))


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def write_trace(requests: Iterable[TraceRequest], path: Path, max_output: int | None = None) -> Path:
    """The requests as a trace file (what vLLM's client replays); answers capped at ``max_output`` tokens."""
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            if max_output is not None and r.output_length > max_output:
                r = dataclasses.replace(r, output_length=max_output)
            f.write(r.to_json() + "\n")
    return path


def select(requests: list[TraceRequest], path: Path | str, start_s: float = 0.0, window_s: float | None = None,
           first: int | None = None) -> list[TraceRequest]:
    """The requests arriving from ``start_s`` on, within ``window_s`` of it, the first ``first`` of them."""
    start_ms = start_s * 1000.0
    out = [r for r in requests if r.timestamp_ms >= start_ms]
    if window_s is not None:
        out = [r for r in out if r.timestamp_ms < start_ms + window_s * 1000.0]
    if first is not None:
        out = out[:first]
    if not out:
        raise TraceError(f"{path}: no request in the window asked for")
    return out


def pieces(request: TraceRequest, tokens_per_id: int) -> list[tuple[int, int]]:
    """``(id, size)`` per piece of the prompt vLLM's client makes (see the module docstring)."""
    out, left = [], request.input_length
    for h in request.hash_ids:
        size = tokens_per_id if left >= tokens_per_id else left
        out.append((h, size))
        left -= size
        if left <= 0:
            break
    return out


def prompt_length(request: TraceRequest, tokens_per_id: int) -> int:
    return sum(size for _, size in pieces(request, tokens_per_id))


def ceiling_tokens(requests: Sequence[TraceRequest], tokens_per_id: int) -> list[int]:
    """Per request, its prefix hit with a cache that never forgets: the trace README's definition.

    The longest run of leading ids already seen (by any earlier request),
    times the tokens per id, capped at the prompt a replay makes. Ids are
    chained to their predecessors, so a seen id counts only after the same
    leading ids (the released trace's ids are unique to their prefix anyway).
    """
    seen: set[int] = set()
    out = []
    for r in requests:
        key, run, counting = 0, 0, True
        for h in r.hash_ids:
            key = hash((key, h))
            if counting and key in seen:
                run += 1
            else:
                counting = False
            seen.add(key)
        out.append(min(run * tokens_per_id, prompt_length(r, tokens_per_id)))
    return out
