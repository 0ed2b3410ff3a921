"""The fetcher's in-place reads: raw page objects from a local file store read straight into paged memory.

Every case is checked against what the usual path (read the value, decode,
scatter) leaves in the cache, through the real Fetcher on CPU_ATTN VEC and
AMX caches: whole objects, the cases that fall back to the usual path
(compressed objects, partial spans), and untrusted input: a header that does
not fit writes nothing, a payload whose checksum fails reports its blocks for
recomputation, a cancelled load writes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from storage import open_store
from storage.outage import OutageGuard
from tests.support.adversarial import torch_random_bits
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
from vllm_kvcodec.format import encode_chunk
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.paged import CpuAttnAmxLayout, CpuAttnVecLayout, Geometry
from vllm_kvcodec.paged.objects import PageObjects
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.stats import ConnectorStats

L, H, D, BS, NB, CHUNK = 4, 2, 32, 32, 40, 128  # 4 blocks a chunk, 2 layers an object
PER = CHUNK // BS
GROUPS = (range(0, 2), range(2, 4))


class Setup:
    """Source caches holding 3 chunks in blocks 0..11, objects saved from them, and empty caches to load into."""

    def __init__(self, tmp_path: Path, layout_cls: type, codec: str = "raw") -> None:
        gen = torch.Generator().manual_seed(7)
        self.layout = layout_cls(Geometry(H, D, BS, torch.bfloat16))
        self.source = [torch_random_bits((NB, H, BS, 2 * D), torch.bfloat16, gen) for _ in range(L)]
        self.objects = PageObjects(BS)
        ns = Namespace(model_id="t", dtype="bfloat16", num_layers=L, num_kv_heads=H, head_dim=D,
                       layout_id=self.objects.namespace_id, tp_size=1, chunk_size=CHUNK, layers_per_object=2)
        self.addresses = ObjectAddresses(ns, 0, GROUPS)
        self.url = f"file://{tmp_path}/store"
        self.store = open_store(self.url)
        self.hashes = [f"{c:032x}" for c in range(3)]
        for c, h in enumerate(self.hashes):
            blocks = torch.arange(c * PER, (c + 1) * PER)
            for g, layers in enumerate(GROUPS):
                key = self.addresses.key(h, g)
                obj = torch.stack([self.layout.read_pages(self.source[layer], blocks) for layer in layers])
                self.store.put(key, encode_chunk(obj, codec, key=key))

    def load(self, store, dest_blocks: list[list[int]], first_token: int = 0) -> tuple[list[torch.Tensor], ConnectorStats, set[int]]:
        caches = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
        stats = ConnectorStats()
        fetcher = Fetcher(store, self.addresses, caches, [self.layout] * L, 1, stats)
        chunks = []
        for h, blocks in zip(self.hashes, dest_blocks):
            slots = [b * BS + t for b in blocks for t in range(BS)][first_token:]
            chunks.append(ChunkLoad(h, [Span(first_token, slots)], blocks))
        job = fetcher.submit([LoadSpec("r", chunks, False)], timeout_s=60)
        assert job.done.wait(60)
        fetcher.shutdown()
        return caches, stats, set(job.failed_blocks)

    def expected_block(self, layer: int, chunk: int, page: int) -> torch.Tensor:
        return self.source[layer][chunk * PER + page]


DEST = [[20, 21, 22, 23], [5, 9, 2, 30], [31, 32, 12, 13]]  # consecutive, scattered, two runs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _check_loaded(s: Setup, caches: list[torch.Tensor], dest=DEST, first_page: int = 0, failed=()) -> None:
    """``dest``'s blocks hold their chunks' pages; every other block but the ``failed`` ones is untouched."""
    written = {b for blocks in dest for b in blocks[first_page:]} | set(failed)
    for layer in range(L):
        for c, blocks in enumerate(dest):
            for page, block in enumerate(blocks[first_page:], start=first_page):
                assert torch.equal(_bits(caches[layer][block]), _bits(s.expected_block(layer, c, page)))
        untouched = [b for b in range(NB) if b not in written]
        assert not caches[layer][untouched].any()


@pytest.mark.parametrize("layout_cls", [CpuAttnVecLayout, CpuAttnAmxLayout])
def test_raw_page_objects_load_in_place_bit_exact(tmp_path: Path, layout_cls) -> None:
    s = Setup(tmp_path, layout_cls)
    caches, stats, failed = s.load(s.store, DEST)
    assert not failed
    _check_loaded(s, caches)
    totals = stats.totals()
    assert totals["loaded_objects"] == totals["objects_read_in_place"] == 6
    assert totals.get("scatter_s", 0.0) == 0.0  # no scatter: read where they go
    # The same load through the usual path (a store that cannot read in ranges) leaves the same bytes.
    memory = open_store("memory://")
    for key in s.store.keys():
        memory.put(key, s.store.get(key))
    usual, usual_stats, failed = s.load(memory, DEST)
    assert not failed and usual_stats.totals()["scatter_s"] > 0
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(caches, usual))


def test_through_the_outage_guard_as_the_connector_opens_it(tmp_path: Path) -> None:
    s = Setup(tmp_path, CpuAttnVecLayout)
    guard = OutageGuard(s.url, open_store)
    caches, stats, failed = s.load(guard, DEST)
    assert not failed and stats.totals().get("scatter_s", 0.0) == 0.0
    _check_loaded(s, caches)


@pytest.mark.parametrize("layout_cls", [CpuAttnVecLayout, CpuAttnAmxLayout])
@pytest.mark.parametrize("codec", ["zstd", "splitzip", "rans"])
def test_compressed_objects_decode_straight_into_their_pages(tmp_path: Path, codec: str, layout_cls) -> None:
    """Read whole, then decoded straight into their pages (random bits: splitzip patches escapes in every extent)."""
    s = Setup(tmp_path, layout_cls, codec)
    caches, stats, failed = s.load(s.store, DEST)
    totals = stats.totals()
    assert not failed and totals["objects_decoded_into_pages"] == 6 and "objects_read_in_place" not in totals
    _check_loaded(s, caches)


def test_a_partial_span_takes_the_usual_path(tmp_path: Path) -> None:
    """Tokens before the span are in vLLM's own cache (shared blocks): never written."""
    s = Setup(tmp_path, CpuAttnVecLayout)
    caches, stats, failed = s.load(s.store, DEST, first_token=2 * BS)
    assert not failed and stats.totals()["scatter_s"] > 0
    _check_loaded(s, caches, first_page=2)


def _payload_offset(s: Setup, key: str) -> tuple[str, int]:
    from vllm_kvcodec.format import read_header

    path = s.store._path(key)
    blob = s.store.get(key)
    return path, os.path.getsize(path) - len(blob) + read_header(blob).payload_offset


def test_a_corrupt_payload_fails_its_blocks_and_only_them(tmp_path: Path) -> None:
    s = Setup(tmp_path, CpuAttnVecLayout)
    key = s.addresses.key(s.hashes[1], 0)
    path, at = _payload_offset(s, key)
    with open(path, "r+b") as f:  # one bit of the payload, behind a valid header
        f.seek(at + 1000)
        byte = f.read(1)
        f.seek(at + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    caches, stats, failed = s.load(s.store, DEST)
    assert failed == set(DEST[1])  # vLLM recomputes them
    assert stats.totals()["load_failures_corrupt"] == 1
    # Every other block bit-exact. The failed ones were written before the checksum could be verified: they
    # are this load's own blocks, which vLLM recomputes before anything reads them.
    _check_loaded(s, caches, dest=[DEST[0], [], DEST[2]], failed=DEST[1])


@pytest.mark.parametrize("damage", ["truncate", "shape"])
def test_an_object_that_does_not_fit_writes_nothing(tmp_path: Path, damage: str) -> None:
    s = Setup(tmp_path, CpuAttnVecLayout)
    key = s.addresses.key(s.hashes[0], 1)
    if damage == "truncate":
        path, _ = _payload_offset(s, key)
        os.truncate(path, os.path.getsize(path) - 4096)
    else:  # a valid object of one layer where this engine's group has two
        s.store.put(key, encode_chunk(s.layout.read_pages(s.source[2], torch.arange(PER))[None], "raw", key=key))
    caches, stats, failed = s.load(s.store, DEST)
    assert failed == set(DEST[0])
    kind = "corrupt" if damage == "truncate" else "mismatch"
    assert stats.totals()[f"load_failures_{kind}"] == 1
    assert not any(caches[layer][DEST[0]].any() for layer in GROUPS[1])  # nothing of it was written
    assert all(torch.equal(_bits(caches[0][b]), _bits(s.expected_block(0, 0, p))) for p, b in enumerate(DEST[0]))


def test_blocks_outside_the_cache_are_refused_before_writing(tmp_path: Path) -> None:
    s = Setup(tmp_path, CpuAttnVecLayout)
    caches, stats, failed = s.load(s.store, [[NB - 2, NB - 1, NB, NB + 1], DEST[1], DEST[2]])
    assert {NB - 2, NB - 1} <= failed
    assert not any(c[NB - 2 :].any() for c in caches)
