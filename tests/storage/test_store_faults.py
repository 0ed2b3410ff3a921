"""The fault-injecting store does what it says, reproducibly, and key-bound chunks survive all of it.

Faults apply to reads only, so every check reads through the wrapper and
compares with what the inner store holds.
"""

from __future__ import annotations

import time

import pytest
import torch

from storage import StoreUnavailableError, StoreURLError, open_store
from storage.testing.faults import FaultInjector
from storage.testing.faults import FAULT_KINDS, find_fault_injector
from storage.memory_store import MemoryStore
from tests.support.adversarial import bits_view
from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import decode_chunk, encode_chunk

RATES = {"drop": 0.15, "truncate": 0.15, "corrupt": 0.15, "delay": 0.05, "swap": 0.15}


def filled(n: int = 40, size: int = 200) -> MemoryStore:
    inner = MemoryStore()
    for i in range(n):
        inner.put(f"kvc/ns/{i:04d}/r0g{i % 2:03d}", bytes((i * 7 + j) % 256 for j in range(size)))
    return inner


def classify(asked: str, got: bytes | None, inner: MemoryStore) -> str:
    """Which fault (if any) turned the stored value of ``asked`` into ``got``."""
    want = inner.get(asked)
    if got is None:
        return "drop"
    if got == want:
        return "none"
    if len(got) < len(want) and want.startswith(got):
        return "truncate"
    if len(got) == len(want) and 1 <= sum((a ^ b).bit_count() for a, b in zip(got, want)) <= 3:
        return "corrupt"
    if any(got == inner.get(k) for k in inner.keys() if k != asked):
        return "swap"
    return "unexplained"


def test_each_read_gets_at_most_one_fault_of_the_given_kinds_at_the_given_rates() -> None:
    inner = filled()
    faulty = FaultInjector(inner, seed=7, delay_s=0.001, **RATES)
    keys = sorted(inner.keys())
    seen = {k: 0 for k in (*FAULT_KINDS, "none", "unexplained")}
    for round_ in range(50):
        for key in keys:
            seen[classify(key, faulty.get(key), inner)] += 1
    reads = 50 * len(keys)
    assert seen["unexplained"] == 0
    counts = faulty.counts()
    assert counts["reads"] == reads
    for kind in ("drop", "truncate", "corrupt", "swap"):
        assert counts[kind] == seen[kind], kind  # the wrapper counts exactly what it did
        assert abs(seen[kind] / reads - RATES[kind]) < 0.04, (kind, seen[kind])
    assert abs(counts["delay"] / reads - RATES["delay"]) < 0.03
    assert seen["none"] == reads - sum(counts[k] for k in FAULT_KINDS) + counts["delay"]  # delayed: intact


def test_swaps_prefer_a_key_of_the_same_layer_group() -> None:
    inner = filled()
    faulty = FaultInjector(inner, seed=1, swap=1.0)
    assert faulty.get("kvc/ns/0000/r0g000") == inner.get("kvc/ns/0000/r0g000")  # no other key seen yet
    faulty.put_many([(k, inner.get(k)) for k in inner.keys()])
    for key in sorted(inner.keys()):
        got = faulty.get(key)
        source = next(k for k in inner.keys() if inner.get(k) == got)
        assert source != key and source.endswith(key[-6:])


def test_delay_returns_the_right_value_late() -> None:
    inner = filled(2)
    faulty = FaultInjector(inner, delay=1.0, delay_s=0.2)
    started = time.monotonic()
    assert faulty.get("kvc/ns/0001/r0g001") == inner.get("kvc/ns/0001/r0g001")
    assert time.monotonic() - started >= 0.2
    assert faulty.counts()["delay"] == 1


def test_same_seed_same_faults_whatever_the_order() -> None:
    inner = filled()
    keys = sorted(inner.keys())
    a = FaultInjector(inner, seed=3, **{**RATES, "delay": 0.0})
    b = FaultInjector(inner, seed=3, **{**RATES, "delay": 0.0})
    c = FaultInjector(inner, seed=4, **{**RATES, "delay": 0.0})
    for store in (a, b, c):  # swap partners come from the keys seen: the same for all three
        store.put_many([(k, inner.get(k)) for k in keys])
    got_a = [a.get(k) for k in keys] + a.get_many(keys)
    got_b = [b.get(k) for k in reversed(keys)][::-1] + b.get_many(keys)
    got_c = [c.get(k) for k in keys] + c.get_many(keys)
    assert got_a == got_b and got_a != got_c


def test_lookups_and_writes_pass_through_untouched() -> None:
    inner = filled(4)
    faulty = FaultInjector(inner, drop=1.0)
    faulty.put("kvc/ns/new/r0g000", b"abc")
    assert inner.get("kvc/ns/new/r0g000") == b"abc"
    assert faulty.exists("kvc/ns/new/r0g000") and faulty.exists_many(["kvc/ns/new/r0g000", "nope"]) == [True, False]
    assert faulty.get("kvc/ns/new/r0g000") is None and faulty.get("missing") is None
    assert faulty.counts()["drop"] == 1  # a miss is not a fault
    # Which operations ran, so a test can tell where its faults could land (reads only: get here, not exists).
    assert faulty.calls_by_op() == {"put": 1, "exists": 1, "exists_many": 1, "get": 2}


def test_down_refuses_every_operation_until_up() -> None:
    inner = filled(2)
    faulty = FaultInjector(inner)
    faulty.down()
    calls = [
        lambda: faulty.get("kvc/ns/0000/r0g000"), lambda: faulty.get_many(["a"]), lambda: faulty.put("a", b"1"),
        lambda: faulty.put_many([("a", b"1")]), lambda: faulty.exists("a"), lambda: faulty.exists_many(["a"]),
        lambda: faulty.delete("a"), lambda: faulty.keys(""),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailableError, match="down"):
            call()
    assert faulty.counts()["down"] == len(calls) and not inner.exists("a")
    ops = ("get", "get_many", "put", "put_many", "exists", "exists_many", "delete", "keys")
    assert faulty.calls_by_op() == dict.fromkeys(ops, 1)  # refused calls are calls too
    faulty.up()
    assert faulty.get("kvc/ns/0000/r0g000") == inner.get("kvc/ns/0000/r0g000")


def test_opened_from_a_url(tmp_path) -> None:
    url = f"faults+link+file://{tmp_path}?seed=5&corrupt=0.5&swap=0.25&delay_s=0.5&gbps=10&down=1"
    with open_store(url) as store:
        faulty = find_fault_injector(store)
        assert faulty is store and faulty.is_down and faulty.seed == 5 and faulty.delay_s == 0.5
        assert faulty.rates == {"drop": 0.0, "truncate": 0.0, "corrupt": 0.5, "delay": 0.0, "swap": 0.25}
        assert store.url.startswith("faults+link+file://")
        faulty.up()
        store.put("a/b", b"x")
        assert faulty.inner.inner.get("a/b") == b"x"


@pytest.mark.parametrize(
    "url,message",
    [
        ("faults+memory://?drop=0.6&corrupt=0.6", "sum to at most 1"),
        ("faults+memory://?drop=2", "<= 1"),
        ("faults+memory://?drop=often", "not a number"),
        ("faults+memory://?seed=-1", ">= 0"),
        ("faults+memory://?flood=1", "unknown option"),
    ],
)
def test_bad_fault_urls_are_rejected_clearly(url: str, message: str) -> None:
    with pytest.raises(StoreURLError, match=message):
        open_store(url)


def test_key_bound_chunks_are_exact_or_rejected_under_every_fault(real_chunks) -> None:
    """The connector's read rule (decode with the key asked for) never returns another chunk's KV."""
    inner = MemoryStore()
    tensors = {}
    for c, chunk in enumerate(real_chunks):
        for g in range(3):
            key = f"kvc/ns/{c:04d}/r0g{g:03d}"
            tensors[key] = chunk[g * 2 : g * 2 + 2, :, :64].contiguous()
            inner.put(key, encode_chunk(tensors[key], "rans", key=key))
    faulty = FaultInjector(inner, seed=11, drop=0.1, truncate=0.2, corrupt=0.3, swap=0.3)
    outcomes = {"exact": 0, "rejected": 0, "missing": 0}
    for _ in range(10):
        for key, want in tensors.items():
            blob = faulty.get(key)
            if blob is None:
                outcomes["missing"] += 1
                continue
            try:
                got = decode_chunk(blob, key=key)
            except ChunkFormatError:
                outcomes["rejected"] += 1
                continue
            assert torch.equal(bits_view(got), bits_view(want)), key
            outcomes["exact"] += 1
    counts = faulty.counts()
    assert counts["swap"] > 0 and counts["corrupt"] > 0 and counts["truncate"] > 0
    assert outcomes["rejected"] == counts["truncate"] + counts["corrupt"] + counts["swap"]
    assert outcomes["missing"] == counts["drop"]
