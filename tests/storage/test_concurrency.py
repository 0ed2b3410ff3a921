"""Eight processes save and load overlapping prefixes through one redis-server and one file store at once.

What the connector's save and load paths do without the engine (eight vLLM
engines do not fit on this machine): real chunk keys (hash chains over token
ids, :func:`~vllm_kvcodec.keys.chain.chunk_hashes`), real SmolLM2 KV, the object
key of each layer group, :func:`encode_chunk` with a codec that differs from
process to process and round to round, ``put_many``; and loads by a batched
existence check, ``get_many`` and :func:`decode_chunk`. Prompts share
prefixes (two processes have identical prompts), so the same keys are
rewritten, with different codecs, while other processes read them.

Every read must be a miss or a whole, valid object that decodes bit-exactly
to the KV of its key: a torn or mixed write would fail its checksum or
compare unequal. The processes come from a forkserver that imported the
codecs once (spawning eight fresh interpreters costs a minute on two cores);
the real Saver/Fetcher are not used because they import vLLM (about 10 s per
process); the engine tests cover those paths.
"""

from __future__ import annotations

import multiprocessing
import random
import time
import traceback
from typing import Any

import pytest
import torch

from vllm_kvcodec.errors import ChunkFormatError
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses, chunk_hashes

PROCESSES = 8
CHUNK_TOKENS = 16
CHUNKS = 8
LAYERS = 6
GROUPS = (range(3), range(3, 6))
ROUNDS = 3
SHARED_CHUNKS = (8, 8, 6, 6, 4, 4, 2, 0)  # process p's prompt starts with this many chunks of the common one
CODECS: tuple[Any, ...] = ("raw", "zstd", "splitzip", "rans", {"id": "video", "backend": "ffv1"})
NAMESPACE = Namespace(model_id="concurrency-test", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=3,
                      head_dim=64, layout_id="canonical", tp_size=1, chunk_size=CHUNK_TOKENS,
                      layers_per_object=3)
ADDRESSES = ObjectAddresses(NAMESPACE, 0, GROUPS)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    common = [rng.randrange(49152) for _ in range(CHUNKS * CHUNK_TOKENS)]
    out = []
    for p, shared in enumerate(SHARED_CHUNKS):
        own = [rng.randrange(49152) for _ in range((CHUNKS - shared) * CHUNK_TOKENS)]
        out.append(common[: shared * CHUNK_TOKENS] + own)
        assert p != 1 or out[1] == out[0]
    return out


def content_slots(all_hashes: list[list[str]]) -> dict[str, int]:
    """Each distinct chunk key its own window of real KV, so a mixed-up object cannot pass as another."""
    unique = sorted({h for hashes in all_hashes for h in hashes})
    return {h: j for j, h in enumerate(unique)}


def expected_kv(kv: torch.Tensor, slot: int) -> torch.Tensor:
    windows = (kv.shape[2] - CHUNK_TOKENS) // CHUNK_TOKENS + 1
    layer0 = (slot // windows) * LAYERS
    t0 = (slot % windows) * CHUNK_TOKENS
    return kv[layer0 : layer0 + LAYERS, :, t0 : t0 + CHUNK_TOKENS].contiguous()


def _save(stores: list, hashes: list[str], kv: torch.Tensor, slots: dict[str, int], codec: Any) -> None:
    for h in hashes:
        chunk = expected_kv(kv, slots[h])
        items = [(ADDRESSES.key(h, g), encode_chunk(chunk[layers.start : layers.stop], codec))
                 for g, layers in enumerate(GROUPS)]
        for store in stores:
            store.put_many(items)


def _load(stores: list, hashes: list[str], kv: torch.Tensor, slots: dict[str, int], counts: dict[str, int]) -> None:
    keys = [(h, g, ADDRESSES.key(h, g)) for h in hashes for g in range(len(GROUPS))]
    for store in stores:
        present = store.exists_many([k for _, _, k in keys])
        blobs = store.get_many([k for _, _, k in keys])
        for (h, g, key), was_there, blob in zip(keys, present, blobs):
            if blob is None:
                counts["misses"] += 1
                counts["vanished"] += was_there  # nothing is ever deleted: exists, then gone, is a bug
                continue
            try:
                out = decode_chunk(blob)
            except ChunkFormatError as exc:
                counts["torn"] += 1
                counts.setdefault("first_error", f"{key}: {exc}")  # type: ignore[arg-type]
                continue
            want = expected_kv(kv, slots[h])[GROUPS[g].start : GROUPS[g].stop]
            if torch.equal(out.view(torch.int16), want.view(torch.int16)):
                counts["exact"] += 1
            else:
                counts["wrong"] += 1


def _worker(p: int, store_urls: list[str], all_prompts: list[list[int]], barrier: Any, results: Any) -> None:
    counts: dict[str, Any] = {"p": p, "saves": 0, "exact": 0, "misses": 0, "torn": 0, "wrong": 0, "vanished": 0}
    t0 = time.perf_counter()
    try:
        from storage import open_store
        from vllm_kvcodec.tools.smollm2 import real_kv

        torch.set_num_threads(1)
        kv = real_kv(1024)
        all_hashes = [chunk_hashes(NAMESPACE, t, CHUNKS) for t in all_prompts]
        slots = content_slots(all_hashes)
        stores = [open_store(url) for url in store_urls]
        for codec in CODECS:  # load the numba kernels / libav codecs before the race starts
            decode_chunk(encode_chunk(kv[:3, :, :CHUNK_TOKENS], codec))
        rng = random.Random(p)
        counts["setup_s"] = time.perf_counter() - t0
        barrier.wait(timeout=120)
        counts["started"] = time.time()
        for r in range(ROUNDS):
            codec = CODECS[(p + r) % len(CODECS)]
            for c in range(CHUNKS):  # save one chunk, then read someone's whole prefix
                _save(stores, all_hashes[p][c : c + 1], kv, slots, codec)
                counts["saves"] += 1
                _load(stores, all_hashes[rng.randrange(PROCESSES)], kv, slots, counts)
        counts["finished"] = time.time()
        for store in stores:
            store.close()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        counts["error"] = traceback.format_exc()
    results.put(counts)


@pytest.mark.redis
def test_eight_processes_share_one_redis_and_one_file_store(redis_url: str, tmp_path, real_kv_1k) -> None:
    from storage import open_store

    for codec in CODECS:  # compile/cache numba kernels once here, so the children only load them
        decode_chunk(encode_chunk(real_kv_1k[:3, :, :CHUNK_TOKENS], codec))
    urls = [redis_url, f"file://{tmp_path / 'store'}"]
    all_prompts = prompts()
    ctx = multiprocessing.get_context("forkserver")  # a clean single-threaded parent; imports paid once
    ctx.set_forkserver_preload([__name__, "storage", "vllm_kvcodec.tools.smollm2"])
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(p, urls, all_prompts, barrier, results)) for p in range(PROCESSES)]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=180) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, errors[0]
    total = {k: sum(r[k] for r in reports) for k in ("saves", "exact", "misses", "torn", "wrong", "vanished")}
    first = next((r["first_error"] for r in reports if "first_error" in r), None)
    assert total["torn"] == 0 and total["wrong"] == 0 and total["vanished"] == 0, (total, first)
    assert max(r["started"] for r in reports) < min(r["finished"] for r in reports)  # all eight ran at once
    assert total["saves"] == PROCESSES * ROUNDS * CHUNKS
    assert total["exact"] > 1000, total  # most reads were hits, each one bit-exact

    all_hashes = [chunk_hashes(NAMESPACE, t, CHUNKS) for t in all_prompts]
    slots = content_slots(all_hashes)
    final = {"saves": 0, "exact": 0, "misses": 0, "torn": 0, "wrong": 0, "vanished": 0}
    stores = [open_store(url) for url in urls]
    for hashes in all_hashes:
        _load(stores, hashes, real_kv_1k, slots, final)
    for store in stores:
        store.close()
    assert final["exact"] == len(urls) * PROCESSES * CHUNKS * len(GROUPS), final


def test_expected_kv_is_distinct_per_key(real_kv_1k) -> None:
    """The check above is only as sharp as the content is unique: distinct keys, distinct KV."""
    all_hashes = [chunk_hashes(NAMESPACE, t, CHUNKS) for t in prompts()]
    slots = content_slots(all_hashes)
    chunks = [expected_kv(real_kv_1k, j) for j in slots.values()]
    assert len({c.view(torch.int16).numpy().tobytes() for c in chunks}) == len(chunks)
    assert all(c.shape == (LAYERS, 2, CHUNK_TOKENS, 3, 64) for c in chunks)
