"""The kvcodec serdes in front of LMCache's own ``fs`` L2 adapter, through LMCache's StorageManager.

Real SmolLM2 KV is written to L1, stored by LMCache's store controller through
``SerdeL2AdapterWrapper`` -> our serializer -> ``FSL2Adapter``, evicted from L1,
and prefetched back (``FSL2Adapter`` -> our deserializer -> L1). LMCache 0.5.6's fs
adapter reads back only objects of the serde's full estimate, so these run the
serdes in ``fixed_ratio`` mode; what the exact-size mode does there is pinned too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.lmcache_mp.harness import evict_l1, fetch, keys_for, l1_drained, same_bits, storage_manager, store
from vllm_kvcodec.lmcache_mp import frame

# Per serde: a fixed_ratio below what it reaches on this KV (rans ~1.44x, zstd ~1.47x, splitzip ~1.33x; raw: 1x + header).
FIXED = {"kvcodec-rans": 1.3, "kvcodec-zstd": 1.3, "kvcodec-splitzip": 1.25, "kvcodec-auto": 1.3, "kvcodec-raw": 0.99}


def fs_adapter(path: Path, serde: dict | None) -> dict:
    spec: dict = {"type": "fs", "base_path": str(path)}
    if serde is not None:
        spec["serde"] = serde
    return spec


def stored_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".data")


@pytest.mark.parametrize("serde", sorted(FIXED))
def test_fixed_ratio_round_trip_through_fs(tmp_path: Path, mp_chunks: list[torch.Tensor], serde: str) -> None:
    """Stored, evicted from L1, read back from disk bit-exact; every file is exactly ceil(raw / fixed_ratio) bytes."""
    keys = keys_for(len(mp_chunks))
    ratio = FIXED[serde]
    # The fs adapter must be imported by LMCache after our serdes are registered: a plug-in adapter
    # listed first (on a store nothing else uses) is what imports vllm_kvcodec.lmcache_mp in a server.
    with storage_manager(fs_adapter(tmp_path / "fs", {"type": serde, "fixed_ratio": ratio})) as sm:
        store(sm, keys, mp_chunks)
        files = stored_files(tmp_path / "fs")
        raw = mp_chunks[0].numel() * mp_chunks[0].element_size()
        assert len(files) == len(keys)
        assert {f.stat().st_size for f in files} == {math.ceil(raw / ratio)}
        evict_l1(sm)
        got = fetch(sm, keys, mp_chunks[0])
        assert all(g is not None and same_bits(g, want) for g, want in zip(got, mp_chunks, strict=True))
        assert l1_drained(sm)


def test_corrupted_file_is_a_miss_never_wrong_bytes(tmp_path: Path, mp_chunks: list[torch.Tensor]) -> None:
    keys = keys_for(len(mp_chunks))
    with storage_manager(fs_adapter(tmp_path / "fs", {"type": "kvcodec-zstd", "fixed_ratio": 1.3})) as sm:
        store(sm, keys, mp_chunks)
        victim = stored_files(tmp_path / "fs")[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 3] ^= 0x40  # one bit, inside the compressed payload
        victim.write_bytes(bytes(data))
        evict_l1(sm)
        got = fetch(sm, keys, mp_chunks[0])
        assert any(g is None for g in got), "a corrupted object was reported as a hit"
        assert all(g is None or same_bits(g, want) for g, want in zip(got, mp_chunks, strict=True))
        assert l1_drained(sm)


def test_over_budget_object_is_not_stored(tmp_path: Path, mp_chunks: list[torch.Tensor]) -> None:
    """fixed_ratio above what the KV compresses to: serialize refuses, nothing reaches disk, a later read misses."""
    keys = keys_for(1)
    with storage_manager(fs_adapter(tmp_path / "fs", {"type": "kvcodec-splitzip", "fixed_ratio": 2.0})) as sm:
        store(sm, keys, mp_chunks[:1])
        assert stored_files(tmp_path / "fs") == []
        evict_l1(sm)
        assert fetch(sm, keys, mp_chunks[0]) == [None]
        assert l1_drained(sm)


def test_exact_mode_on_lmcache_fs_stores_compressed_but_reads_back_as_a_miss(
    tmp_path: Path, mp_chunks: list[torch.Tensor]
) -> None:
    """Why fixed_ratio exists: LMCache 0.5.6 narrows the stored object to what serialize wrote, but its fs
    adapter only reads a file of the full estimate back. The result is a miss (recompute), never wrong bytes."""
    keys = keys_for(1)
    with storage_manager(fs_adapter(tmp_path / "fs", {"type": "kvcodec-zstd"})) as sm:
        store(sm, keys, mp_chunks[:1])
        (stored,) = stored_files(tmp_path / "fs")
        raw = mp_chunks[0].numel() * mp_chunks[0].element_size()
        assert stored.stat().st_size < raw / 1.3  # compressed bytes only
        assert frame.is_frame(stored.read_bytes())
        evict_l1(sm)
        assert fetch(sm, keys, mp_chunks[0]) == [None]
        assert l1_drained(sm)


def test_object_from_another_serde_is_refused(tmp_path: Path, mp_chunks: list[torch.Tensor]) -> None:
    """An fp8-serde object read through kvcodec-zstd (sized so the fs adapter hands it over): a miss, and the
    frame reader names the cause."""
    keys = keys_for(1)
    with storage_manager(fs_adapter(tmp_path / "fs", {"type": "fp8"})) as sm:
        store(sm, keys, mp_chunks[:1])
    (stored,) = stored_files(tmp_path / "fs")
    with pytest.raises(ValueError, match="not written by a kvcodec serde"):
        frame.unpack(stored.read_bytes())
    # fp8 writes 1 byte per bf16 value: fixed_ratio 2 makes our buffer the same size, so the fs adapter loads it.
    with storage_manager(fs_adapter(tmp_path / "fs", {"type": "kvcodec-zstd", "fixed_ratio": 2.0})) as sm:
        assert fetch(sm, keys, mp_chunks[0]) == [None]
        assert l1_drained(sm)
