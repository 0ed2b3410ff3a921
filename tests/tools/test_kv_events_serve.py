"""What a router receives: the store's KV cache events from a real ``vllm serve``, over ZMQ, as msgpack.

One ``kvcodec serve`` with ``--kv-events-config`` publishing to a ZMQ SUB
socket this test binds (an endpoint that is not a wildcard makes vLLM's
publisher connect to it, as a router's indexer would be reached). After one
request of three whole chunks, the connector's ``BlockStored`` events arrive
with medium ``KVCODEC``, and their block hashes are vLLM's block hashes of
those tokens: computed here from the token ids with vLLM's hash function and
seed (what a router computes for an incoming prompt), and equal to the hashes
of vLLM's own GPU ``BlockStored`` events for the same blocks. Events are read
the way a router reads them: raw msgpack, ``[ts, [event, ...], dp_rank]``
with each event a map tagged by ``type``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.vllm_server import ENGINE_ARGS, free_port, running, server_env

pytestmark = pytest.mark.engine

CHUNK, BLOCK = 256, 128  # the connector's default chunk, the server's --block-size (ENGINE_ARGS)
FULL_CHUNKS = 3
PROMPT = list(range(2000, 2000 + FULL_CHUNKS * CHUNK + 20))  # three whole chunks and a tail that is not stored
OTHER = list(range(7000, 7040))  # shorter than a chunk: steps the engine once more
MEDIUM = "KVCODEC"


def model() -> str:
    from vllm_kvcodec.tools.smollm2 import model_dir

    return str(model_dir())


def router_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The block hashes a router computes for ``tokens``: vLLM's sha256 chain from its fixed seed, as 64-bit ints."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    init_none_hash(fn)  # "vllm-none-hash" (or PYTHONHASHSEED, which the server inherits from this process)
    parent, out = None, []
    for b in range(len(tokens) // block_size):
        parent = hash_block_tokens(fn, parent, tokens[b * block_size : (b + 1) * block_size], None)
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default)
    return out


#: The router's side: a separate process (as a router's indexer is) that binds a SUB socket and writes every
#: event it receives, decoded from msgpack as a router decodes them, as one JSON line.
SUBSCRIBER = """
import json, sys, msgspec, zmq
sub = zmq.Context.instance().socket(zmq.SUB)
sub.bind(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
print("ready", flush=True)
with open(sys.argv[2], "a") as out:
    while True:
        _topic, _seq, payload = sub.recv_multipart()
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for event in events:
            out.write(json.dumps(event) + chr(10))
            out.flush()
"""


@contextlib.contextmanager
def subscriber(endpoint: str, path: Path) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait(10)


def received(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def receive(path: Path, until: float, done: Callable[[list[dict]], bool]) -> list[dict]:
    """The events received so far, once ``done`` holds of them or the time is up."""
    while not done(events := received(path)) and time.monotonic() < until:
        time.sleep(0.2)
    return events


def wait_for_objects(root: Path, n: int, timeout_s: float = 120.0) -> None:
    """Until the file store holds ``n`` objects: the saves of the request landed."""
    deadline = time.monotonic() + timeout_s
    while sum(1 for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")) < n:
        assert time.monotonic() < deadline, f"the store holds fewer than {n} objects after {timeout_s:.0f} s"
        time.sleep(0.2)


def stored_by(events: list[dict], medium: str) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored" and e.get("medium") == medium]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every event the server published for one request of three chunks (and one short one after it)."""
    tmp = tmp_path_factory.mktemp("kv-events")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    argv = ["-m", "vllm_kvcodec.tools.cli", "serve", model(), "--store", f"file://{tmp / 'store'}",
            "--kv-events-config", json.dumps(events_config), *ENGINE_ARGS]
    log = tmp / "events.jsonl"
    with subscriber(endpoint, log), running(argv, tmp / "server.log", server_env()) as server:
        server.complete(PROMPT, max_tokens=4)
        wait_for_objects(tmp / "store", FULL_CHUNKS)
        time.sleep(0.5)  # the saver reports an outcome right after its put
        # A save that lands after the engine's last step is published with its next one (see docs/routers.md).
        server.complete(OTHER)
        events = receive(log, time.monotonic() + 60, lambda ev: len(stored_by(ev, MEDIUM)) >= FULL_CHUNKS)
        kinds = collections.Counter((e["type"], e.get("medium")) for e in events)
        assert len(stored_by(events, MEDIUM)) >= FULL_CHUNKS, f"received {kinds}; log:\n{server.log()[-3000:]}"
        return events


def test_the_stored_chunks_arrive_with_their_medium_in_vllm_block_hashes(published: list[dict]) -> None:
    chain = router_hashes(PROMPT, BLOCK)
    per_chunk = CHUNK // BLOCK
    stored = stored_by(published, MEDIUM)
    assert len(stored) == FULL_CHUNKS, stored
    for c in range(FULL_CHUNKS):
        first = c * per_chunk
        (event,) = [e for e in stored if e["block_hashes"] == chain[first : first + per_chunk]]
        assert event["parent_block_hash"] == (chain[first - 1] if first else None)
        assert event["token_ids"] == PROMPT[c * CHUNK : (c + 1) * CHUNK]
        assert event["block_size"] == BLOCK
        assert event["locality"] == "LOCAL"  # a file store on this host
    assert not [e for e in published if e["type"] == "BlockRemoved" and e.get("medium") == MEDIUM]


def test_the_hashes_equal_those_of_vllm_s_own_gpu_events_for_the_same_blocks(published: list[dict]) -> None:
    gpu = {h: e for e in published if e["type"] == "BlockStored" and e.get("medium") == "GPU" for h in e["block_hashes"]}
    ours = [h for e in stored_by(published, MEDIUM) for h in e["block_hashes"]]
    assert len(ours) == FULL_CHUNKS * CHUNK // BLOCK
    assert set(ours) <= set(gpu), "a store hash vLLM never published for its GPU cache"
