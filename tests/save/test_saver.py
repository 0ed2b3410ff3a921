"""The Saver's encoding threads yield the CPU to the engine (nice), and what they store is still what they were given."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from storage.memory_store import MemoryStore
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.format import decode_chunk
from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
from vllm_kvcodec.save.saver import Saver
from vllm_kvcodec.stats import ConnectorStats

NAMESPACE = Namespace(model_id="saver-test", dtype="bfloat16", num_layers=4, num_kv_heads=3, head_dim=64,
                      layout_id="canonical", tp_size=1, chunk_size=16, layers_per_object=2)
ADDRESSES = ObjectAddresses(NAMESPACE, 0, (range(2), range(2, 4)))

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority on this platform")


class PriorityRecordingStore(MemoryStore):
    """A memory store that notes the nice value of the thread each put runs on (the Saver's)."""

    def __init__(self) -> None:
        super().__init__()
        self.nice_at_put: list[int] = []

    def put_many(self, items):
        self.nice_at_put.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        super().put_many(items)


def _save_one(nice: int) -> tuple[PriorityRecordingStore, torch.Tensor]:
    store = PriorityRecordingStore()
    saver = Saver(store, ADDRESSES, CodecChooser("rans"), 2, 1 << 30, ConnectorStats(), nice=nice)
    kv = torch.randn(4, 2, 16, 3, 64).to(torch.bfloat16)
    try:
        assert saver.submit("ab" * 16, kv, "r1", tokens=16)
        assert saver.flush(60)
    finally:
        saver.shutdown()
    return store, kv


@pytest.mark.parametrize("nice", [10, 3])
def test_save_threads_run_below_the_engine_and_store_the_exact_kv(nice: int) -> None:
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store, kv = _save_one(nice)
    assert store.nice_at_put and all(n == min(19, engine_nice + nice) for n in store.nice_at_put)
    for g, layers in enumerate(ADDRESSES.groups):
        got = decode_chunk(store.get(ADDRESSES.key("ab" * 16, g)))
        assert torch.equal(got.view(torch.int16), kv[layers.start : layers.stop].view(torch.int16))
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == engine_nice  # the caller's own is untouched


def test_nice_zero_keeps_the_engines_priority() -> None:
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store, _ = _save_one(0)
    assert store.nice_at_put == [engine_nice]
