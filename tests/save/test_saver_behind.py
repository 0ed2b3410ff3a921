"""A saver that falls behind the engine encodes the backlog with the cheaper codec, and stores the exact KV either way."""

from __future__ import annotations

import threading

import torch

from storage.memory_store import MemoryStore
from vllm_kvcodec.codecs import get_codec
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.format import decode_chunk, read_header
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.save.saver import Saver
from vllm_kvcodec.stats import ConnectorStats

NAMESPACE = Namespace(model_id="saver-behind-test", dtype="bfloat16", num_layers=4, num_kv_heads=3, head_dim=64,
                      layout_id="canonical", tp_size=1, chunk_size=16, layers_per_object=2)
ADDRESSES = ObjectAddresses(NAMESPACE, 0, (range(2), range(2, 4)))


class GatedStore(MemoryStore):
    """Each put waits for ``gate``; ``entered`` is set once the first one started (its chunk is already encoded)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        assert self.gate.wait(30)
        super().put_many(items)


def _save_backlog(behind: str | None) -> tuple[GatedStore, ConnectorStats, list[torch.Tensor]]:
    """One save thread; chunk 0 is being put while chunks 1-3 are queued behind it."""
    store, stats = GatedStore(), ConnectorStats()
    chooser = CodecChooser("rans", behind=None if behind is None else get_codec(behind))
    saver = Saver(store, ADDRESSES, chooser, 1, 1 << 30, stats)
    chunks = [torch.randn(4, 2, 16, 3, 64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
              for i in range(4)]
    try:
        assert saver.submit(f"{0:032x}", chunks[0], "r", tokens=16)
        assert store.entered.wait(30)
        for i in range(1, 4):
            assert saver.submit(f"{i:032x}", chunks[i], "r", tokens=16)
        store.gate.set()
        assert saver.flush(60)
    finally:
        saver.shutdown()
    return store, stats, chunks


def test_chunks_queued_behind_a_full_round_take_the_cheaper_codec_and_round_trip() -> None:
    store, stats, chunks = _save_backlog("splitzip")
    used = []
    for i, kv in enumerate(chunks):
        for g, layers in enumerate(ADDRESSES.groups):
            blob = store.get(ADDRESSES.key(f"{i:032x}", g))
            assert torch.equal(decode_chunk(blob).view(torch.int16), kv[layers.start : layers.stop].view(torch.int16))
        used.append(read_header(blob).codec_id)
    # chunk 0 started with nothing queued; 1 and 2 each had a round (one thread's worth) behind them; 3 had none
    assert used == ["rans", "splitzip", "splitzip", "rans"]
    totals = stats.totals()
    assert totals["saves_behind"] == 2 and totals["codec_splitzip_saves"] == 2 and totals["saved_chunks"] == 4


def test_without_a_cheaper_codec_the_backlog_keeps_the_configured_one() -> None:
    store, stats, _ = _save_backlog(None)
    assert {read_header(store.get(ADDRESSES.key(f"{i:032x}", 0))).codec_id for i in range(4)} == {"rans"}
    assert stats.totals()["saves_behind"] == 2  # still counted: the saver was behind


def test_a_codec_cheaper_to_encode_than_the_fallback_is_kept_when_behind() -> None:
    from vllm_kvcodec.codecs.policy import encode_rank

    chooser = CodecChooser("raw", behind=get_codec("splitzip"))
    sample = torch.zeros(2, 2, 16, 3, 64, dtype=torch.bfloat16)
    assert chooser.codec_for(sample, behind=True).codec_id == "raw"
    assert CodecChooser({"id": "zstd", "level": 3}, behind=get_codec("splitzip")).codec_for(sample, behind=True).codec_id == "splitzip"
    assert encode_rank(get_codec("splitzip")) < encode_rank(get_codec({"id": "zstd", "level": 1})) < encode_rank(get_codec("rans"))
