"""Objects stored with the fallback codec are re-encoded with the configured one once a load fetches them.

Real SmolLM2 KV, saved as splitzip (what the saver writes while it is behind),
loaded through the real Fetcher into CPU_ATTN caches from a real file store
and a memory store; the Upgrader then writes rans objects over the same keys.
Every object must still decode to the KV that was saved, and a second load
must put the same bits in paged memory. While the saver has work, nothing is
re-encoded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage import open_store
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec
from vllm_kvcodec.format import decode_chunk, encode_chunk, read_header
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.paged import CpuAttnVecLayout, Geometry
from vllm_kvcodec.paged.objects import CanonicalObjects
from vllm_kvcodec.save.saver import Saver
from vllm_kvcodec.save.upgrade import Upgrader
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.stats import ConnectorStats

L, H, D, BS, NB, CHUNK = 4, 3, 64, 32, 40, 256
GROUPS = (range(0, 2), range(2, 4))
PER = CHUNK // BS


class Setup:
    """Three real chunks stored as splitzip objects, a saver and an upgrader to rans on the same store."""

    def __init__(self, store_url: str, real_kv_1k: torch.Tensor) -> None:
        self.layout = CpuAttnVecLayout(Geometry(H, D, BS, torch.bfloat16))
        ns = Namespace(model_id="upgrade-test", dtype="bfloat16", num_layers=L, num_kv_heads=H, head_dim=D,
                       layout_id=CanonicalObjects().namespace_id, tp_size=1, chunk_size=CHUNK, layers_per_object=2)
        self.addresses = ObjectAddresses(ns, 0, GROUPS)
        self.store = open_store(store_url)
        self.chunks = [c.contiguous() for c in real_kv_1k[:L].split(CHUNK, dim=2)[:3]]
        self.hashes = [f"{c:032x}" for c in range(3)]
        self.keys = [self.addresses.key(h, g) for h in self.hashes for g in range(len(GROUPS))]
        self.objects = {self.addresses.key(h, g): kv[layers.start : layers.stop].contiguous()
                        for h, kv in zip(self.hashes, self.chunks) for g, layers in enumerate(GROUPS)}
        for key, obj in self.objects.items():
            self.store.put(key, encode_chunk(obj, "splitzip", key=key))
        self.stats = ConnectorStats()
        self.chooser = CodecChooser("rans", behind=get_codec("splitzip"))
        self.chooser.token_axis = CanonicalObjects().token_axis
        self.saver = Saver(self.store, self.addresses, self.chooser, 1, 1 << 30, self.stats)
        self.upgrader = Upgrader(self.store, self.chooser, self.saver.idle, self.stats)

    def load(self) -> tuple[list[torch.Tensor], set[int]]:
        caches = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
        fetcher = Fetcher(self.store, self.addresses, caches, [self.layout] * L, 2, self.stats)
        fetcher.after_load = self.upgrader.offer
        chunks = [ChunkLoad(h, [Span(0, list(range(c * CHUNK, (c + 1) * CHUNK)))], list(range(c * PER, (c + 1) * PER)))
                  for c, h in enumerate(self.hashes)]
        job = fetcher.submit([LoadSpec("r", chunks, False)], timeout_s=60)
        assert job.done.wait(60)
        fetcher.shutdown()
        assert self.upgrader.flush(60)
        return caches, set(job.failed_blocks)

    def stored_codecs(self) -> list[str]:
        return [read_header(self.store.get(k), key=k).codec_id for k in self.keys]

    def close(self) -> None:
        self.upgrader.shutdown()
        self.saver.shutdown()


@pytest.fixture(params=["file", "memory"])
def store_url(request, tmp_path: Path) -> str:
    return f"file://{tmp_path}/store" if request.param == "file" else "memory://"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_a_loaded_fallback_object_is_replaced_by_a_denser_one_bit_exact(store_url: str, real_kv_1k: torch.Tensor) -> None:
    s = Setup(store_url, real_kv_1k)
    try:
        before = sum(len(s.store.get(k)) for k in s.keys)
        first, failed = s.load()
        assert not failed
        assert s.stored_codecs() == ["rans"] * len(s.keys)
        for key, obj in s.objects.items():
            assert torch.equal(_bits(decode_chunk(s.store.get(key), key=key)), _bits(obj))
        after = sum(len(s.store.get(k)) for k in s.keys)
        totals = s.stats.totals()
        assert totals["upgraded_objects"] == len(s.keys)
        assert totals["upgraded_bytes_before"] == before and totals["upgraded_bytes_after"] == after < before
        # The upgraded objects load to the same bits, and are not offered again.
        second, failed = s.load()
        assert not failed
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(first, second))
        assert s.stats.totals()["upgraded_objects"] == len(s.keys)
        assert s.stats.totals()["codec_rans_loads"] == len(s.keys)
    finally:
        s.close()


def test_nothing_is_re_encoded_while_the_saver_has_work(real_kv_1k: torch.Tensor) -> None:
    s = Setup("memory://", real_kv_1k)
    try:
        assert s.saver.reserve(1 << 20)  # a chunk being gathered for saving: the saver is not idle
        _, failed = s.load()
        assert not failed
        assert s.stored_codecs() == ["splitzip"] * len(s.keys)
        assert s.stats.totals()["upgrades_skipped_busy"] == len(s.keys)
        assert "upgraded_objects" not in s.stats.totals()
        s.saver.unreserve(1 << 20)
        _, failed = s.load()  # idle again: the next hit upgrades them
        assert not failed and s.stored_codecs() == ["rans"] * len(s.keys)
    finally:
        s.close()


def test_a_damaged_copy_held_for_upgrading_is_never_written(real_kv_1k: torch.Tensor) -> None:
    """The upgrader re-validates what it holds: a blob whose checksum fails leaves the stored object alone."""
    s = Setup("memory://", real_kv_1k)
    try:
        key = s.keys[0]
        blob = bytearray(s.store.get(key))
        header = read_header(blob, key=key)
        blob[-1] ^= 0xFF
        assert s.upgrader.offer(key, blob, header)
        assert s.upgrader.flush(60)
        assert s.stats.totals()["upgrade_failures"] == 1
        assert read_header(s.store.get(key), key=key).codec_id == "splitzip"
    finally:
        s.close()


@pytest.mark.parametrize("since", ["saved anew", "deleted"])
def test_an_upgrade_never_writes_over_what_the_key_holds_since_its_load(since: str, store_url: str,
                                                                         real_kv_1k: torch.Tensor) -> None:
    """The load read a fallback-coded object; before the upgrade is written, the key was saved anew (by another
    instance, with another codec) or deleted: the newer state stays, and the upgrade counts as superseded."""
    s = Setup(store_url, real_kv_1k)
    try:
        key = s.keys[0]
        read = s.store.get(key)
        newer = encode_chunk(s.objects[key], "raw", key=key)
        if since == "saved anew":
            s.store.put(key, newer)
        else:
            s.store.delete(key)
        assert s.upgrader.offer(key, read, read_header(read, key=key))
        assert s.upgrader.flush(60)
        assert s.store.get(key) == (newer if since == "saved anew" else None)
        totals = s.stats.totals()
        assert totals["upgrades_superseded"] == 1 and "upgraded_objects" not in totals
    finally:
        s.close()
