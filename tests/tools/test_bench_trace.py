"""kvcodec bench trace: a trace replayed through vllm-router and vLLM's client on real servers, and simulated.

The replays run a small trace written here in the Mooncake format (chats of
a few turns, each turn's ids extending the last's, interleaved so that round
robin sends a chat's turns to different workers), so they never depend on the
real trace's file. Arrivals are spaced so each request is done before the next
(``min_gap_s``): then the sequential simulator must predict every request's
local / store / computed split exactly.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvcodec.tools.bench import trace
from vllm_kvcodec.tools.bench.trace_file import TraceRequest, write_trace

CHATS, TURNS = 3, 4  # an odd number of chats: round robin sends a chat's turns to both workers in turn


def chat_trace(path: Path, chats: int = CHATS, turns: int = TURNS, gap_ms: int = 1000, seed: int = 3) -> Path:
    """Interleaved chats: turn t of every chat, then turn t + 1; each turn adds 2-4 ids, its last piece short."""
    rng = random.Random(seed)
    next_id, ids, rows = 1, {c: [0] for c in range(chats)}, []  # every chat starts with id 0 (a system prompt)
    for t in range(turns):
        for c in range(chats):
            new = rng.randint(2, 4)
            ids[c] = ids[c] + list(range(next_id, next_id + new))
            next_id += new
            length = 512 * len(ids[c]) - rng.randint(1, 400)  # the last piece short at 32 tokens per id too
            rows.append(TraceRequest(len(rows), float(len(rows) * gap_ms), length, rng.randint(1, 9), tuple(ids[c])))
    return write_trace(rows, path)


def kvcodec(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_kvcodec.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def require_router() -> None:
    from vllm_kvcodec.tools.router_process import MISSING, find_router

    if find_router() is None:  # the router extra is installed by make test, like redis-server
        pytest.fail(MISSING, pytrace=False)


def test_the_replay_refuses_in_one_line_when_a_part_is_missing(tmp_path, monkeypatch) -> None:
    done = kvcodec("bench", "trace", "--trace", str(tmp_path / "absent.jsonl"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: trace file ") and "not found" in done.stderr
    spec = trace.ReplaySpec(trace=chat_trace(tmp_path / "t.jsonl"))
    monkeypatch.setattr("vllm_kvcodec.tools.router_process.find_router", lambda: None)
    with pytest.raises(trace.MissingPart, match=r"vllm-router is not installed: pip install 'vllm-kvcodec\[router\]'"):
        trace.check_parts(spec)
    monkeypatch.undo()
    monkeypatch.setattr("storage.testing.redis_server.find_redis_server", lambda: None)
    with pytest.raises(trace.MissingPart, match="redis-server is not on PATH"):
        trace.check_parts(spec)
    monkeypatch.undo()
    with pytest.raises(trace.MissingPart, match="unknown configuration"):
        trace.check_parts(trace.ReplaySpec(trace=spec.trace, configs="az"))


def test_a_malformed_trace_is_refused_by_line_before_anything_runs(tmp_path) -> None:
    bad = chat_trace(tmp_path / "t.jsonl")
    text = bad.read_text().splitlines()
    text[4] = text[4].replace('"input_length": ', '"input_length": -')
    bad.write_text("\n".join(text) + "\n")
    for args in (["--simulate", str(bad)], ["--trace", str(bad)]):
        done = kvcodec("bench", "trace", *args, "--json", str(tmp_path / "o.json"))
        assert done.returncode == 2, done.stderr
        assert f"{bad}:5: input_length must be an integer >= 1" in done.stderr
        assert not (tmp_path / "o.json").exists()


def test_the_simulator_command_writes_shares(tmp_path) -> None:
    out = tmp_path / "sim.json"
    done = kvcodec("bench", "trace", "--simulate", str(chat_trace(tmp_path / "t.jsonl")), "--workers", "2",
                   "--local-tokens", "0", "--store-bytes", "0", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    shares = result["shares"]
    assert set(shares) == {"local", "store", "computed"} and sum(shares.values()) == pytest.approx(1.0)
    assert shares["local"] == 0 and shares["store"] > 0.5  # no local cache: every turn's history from the store
    assert result["requests"] == CHATS * TURNS


@pytest.mark.engine
@pytest.mark.redis
def test_a_smoke_replay_through_the_router_is_predicted_request_by_request(tmp_path) -> None:
    require_router()
    spec = trace.ReplaySpec(trace=chat_trace(tmp_path / "t.jsonl"), first=None, configs="cd", min_gap_s=1.5,
                            client_timeout_s=600, work_dir=tmp_path / "work")
    result = trace.run(spec, tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text())["configs"][0]["config"] == "c"
    n = CHATS * TURNS
    for c in result["configs"]:
        assert c["completed"] == n and c["failed"] == 0, c["errors"]
        ledger = c["per_request"]
        assert sorted(r["index"] for r in ledger) == list(range(n))
        # each request's split (its worker's scheduler) sums to what vLLM's own counters say
        assert sum(r["local"] for r in ledger) == c["tokens_by_source"]["local_cache_hit"]
        assert sum(r["store"] for r in ledger) == c["tokens_by_source"]["external_kv_transfer"]
        assert sum(r["computed"] for r in ledger) == c["tokens_by_source"]["local_compute"]
        assert c["stored_objects"] > 0 and c["stored_ratio"] > 1.3  # rans, read back from the store's headers
        cmp = c["comparison"]
        assert cmp["compared"] and cmp["exact"] == n, cmp["disagreements"]
    by = {c["config"]: c for c in result["configs"]}
    # round robin sends turns of a chat to both workers: the store serves what the other one computed
    assert by["c"]["shares_vllm"]["store"] > 0.1 and by["c"]["far_bytes_read"] > 0
    assert {r["worker"] for r in by["c"]["per_request"]} == {0, 1}
    # kv_aware heard the connector's store events through the relay (both workers' streams)
    assert all(n > 0 for n in by["d"]["relayed_events"])
    assert by["d"]["shares_vllm"]["computed"] <= by["c"]["shares_vllm"]["computed"] + 1e-9
    assert result["ceiling_share"] > 0.5


@pytest.mark.engine
@pytest.mark.redis
def test_a_worker_killed_mid_replay_shows_as_failed_requests_and_the_run_ends(tmp_path) -> None:
    require_router()
    spec = trace.ReplaySpec(trace=chat_trace(tmp_path / "t.jsonl"), first=8, configs="a", kill_worker_after_s=5.0,
                            client_timeout_s=300)
    result = trace.run(spec, None)
    (a,) = result["configs"]
    assert a["workers_killed"] == [1]
    assert a["failed"] > 0 and a["completed"] + a["failed"] == 8
    assert not a["comparison"]["compared"]
