"""The GPU load and save paths (gpu/scatter_triton, gpu/staging, load/cuda_placement, save/cuda_gather).

Three kinds of tests:

* the kernels and the whole pipeline on CPU tensors in Triton's interpreter,
  bit-exact against the CPU layout and fetcher: ``tests/gpu/interpreted_gpu_load.py``,
  run here in ONE child ``pytest`` with ``TRITON_INTERPRET=1`` set in the child
  only (the interpreter must be chosen before triton is first imported, and
  other modules of this suite import triton through vLLM without it);
* the host-side parts that need no kernel (staging pool, job bookkeeping);
* ``@pytest.mark.gpu``: the same checks compiled on a CUDA device, with real
  streams and events; skipped where there is no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_kvcodec.gpu.staging import StagingPool, align8, host_slots

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "interpreted_gpu_load.py"
MIN_CASES = 53  # what the file holds today; fewer means cases silently stopped being collected



def test_interpreted_cases_pass(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert report.exists(), f"the child pytest wrote no report (rc={proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {c.get("name"): [e.tag for e in c if e.tag in ("failure", "error", "skipped")] for c in cases}
    bad = {name: tags for name, tags in outcomes.items() if tags}
    assert not bad, f"{bad}\n{proc.stdout[-6000:]}"
    assert len(outcomes) >= MIN_CASES, sorted(outcomes)
    assert proc.returncode == 0, proc.stdout[-3000:]


# ---- host-side parts ---------------------------------------------------------------------------------


def test_staging_pool_reuses_and_grows() -> None:
    pool = StagingPool(1, pin=False)
    with pool.take(100) as a:
        assert a.numel() == 100 and a.dtype == torch.uint8
        first = a.data_ptr()
    with pool.take(200) as b:  # fits the buffer allocated for 100 bytes (1 MiB granules)
        assert b.data_ptr() == first
    assert pool.allocations == 1
    with pool.take(3 << 20) as c:  # bigger than the buffer: it grows
        assert c.numel() == 3 << 20
    assert pool.allocations == 2


def test_staging_pool_is_bounded() -> None:
    pool = StagingPool(2, pin=False)
    with pool.take(10) as x, pool.take(10) as y:  # both buffers out: a third take waits, then gives up
        assert x.data_ptr() != y.data_ptr()
        with pytest.raises(TimeoutError), pool.take(10, timeout=0.05):
            pass
    assert pool.allocations == 2


def test_staging_pool_blocks_until_a_buffer_returns() -> None:
    pool = StagingPool(1, pin=False)
    got: list[float] = []

    def second() -> None:
        with pool.take(8, timeout=10):
            got.append(time.monotonic())

    with pool.take(8):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.1)
        released = time.monotonic()
        assert not got
    t.join(10)
    assert got and got[0] >= released


def test_host_slots_are_int64_views_of_the_staging_buffer() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    view = host_slots(buf, align8(5), [3, 1 << 40, 0])
    assert view.tolist() == [3, 1 << 40, 0]
    assert view.data_ptr() == buf.data_ptr() + 8
    with pytest.raises(ValueError):
        host_slots(buf, 4, [1])


def test_worker_loads_cpu_caches_with_the_thread_fetcher() -> None:
    from vllm_kvcodec.load.fetcher import Fetcher
    from vllm_kvcodec.connector.worker_half import _fetcher_class

    assert _fetcher_class([torch.zeros(1)]) is Fetcher


class _Event:
    """Stands in for a CUDA event (there is none without a GPU): whether the work before it has run."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_block_reads_name_the_pending_gathers_of_the_blocks_a_load_writes() -> None:
    """A finishing tail's gather read blocks 3 and 4, a later step's gather blocks 4 and 9: a load into block 4
    waits for both, into 3 for the first, into 5 for none; once a gather has run its blocks are forgotten."""
    from vllm_kvcodec.gpu.block_reads import BlockReads, layout_blocks

    reads, tail, later = BlockReads(), _Event(), _Event()
    reads.record(layout_blocks([48, 63, 64, 70], 16), tail)  # slots of blocks 3 and 4
    reads.record([4, 9], later)
    reads.record([5], None)  # a CPU device: copies are done when they return, nothing to wait for
    assert reads.pending([4]) == [later], "the last read of a block is the one to wait for"
    assert reads.pending([3, 4]) == [tail, later] and reads.pending([5, 6]) == []
    tail.done = True
    assert reads.pending([3, 4]) == [later] and len(reads) == 2  # blocks 4 and 9 still being read
    later.done = True
    assert reads.pending([3, 4, 9]) == [] and len(reads) == 0


def test_cpu_load_job_settle_is_free() -> None:
    from vllm_kvcodec.load.load_job import LoadJob

    job = LoadJob([[0, 1]], 0, ["r"])
    assert job.done.is_set()
    job.settle()  # no stream to order: returns at once


# ---- on a GPU -----------------------------------------------------------------------------------------


def _interpreted_here() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


#: compiled kernels on a CUDA device (TRITON_INTERPRET=1 in this process would interpret them instead)
cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or _interpreted_here(),
    reason="needs a CUDA GPU" if not torch.cuda.is_available() else "TRITON_INTERPRET=1 in this process",
)


@pytest.mark.gpu
@cuda_kernels
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cuda_scatter_gather_match_the_layout(real_chunks, order) -> None:
    from vllm_kvcodec.tools import gpu_load_check as lc
    from vllm_kvcodec.gpu.scatter_triton import PackedPages
    from vllm_kvcodec.paged import Geometry, PackedKVLayout

    kv = real_chunks[2][:, :, 7:200].cuda()
    layers, _, tokens, heads, head = kv.shape
    sc_caches = _cuda_caches(layers, 64, heads, 16, head, order)
    want = [c.clone() for c in sc_caches]
    gen = torch.Generator().manual_seed(5)
    slots = (torch.randperm(64, generator=gen)[:13][(torch.arange(tokens) + 3) // 16] * 16 + (torch.arange(tokens) + 3) % 16).cuda()
    PackedPages(sc_caches, head).scatter(0, kv, slots)
    layout = PackedKVLayout(Geometry(heads, head, 16, kv.dtype))
    for i in range(layers):
        layout.scatter(want[i], slots, kv[i].contiguous())
    torch.cuda.synchronize()
    assert all(torch.equal(lc.bits(g), lc.bits(w)) for g, w in zip(sc_caches, want))
    out = torch.empty((layers, 2, tokens, heads, head), dtype=kv.dtype, device="cuda")
    PackedPages(sc_caches, head).gather(0, slots, out)
    assert torch.equal(lc.bits(out), lc.bits(kv))


def _cuda_caches(layers, blocks, heads, block, head, order):
    shape = (layers, blocks, block, heads, 2 * head) if order == "NHD" else (layers, blocks, heads, block, 2 * head)
    whole = torch.randint(-32768, 32767, shape, dtype=torch.int16, device="cuda").view(torch.bfloat16)
    return [whole[i].transpose(1, 2) if order == "NHD" else whole[i] for i in range(layers)]


@pytest.mark.gpu
@cuda_kernels
@pytest.mark.parametrize("codecs,on_device", [(["splitzip", "rans"], 3), (["int8", "splitzip", "int4"], 9)],
                         ids=["lossless", "lossy"])
def test_cuda_fetcher_events_and_bit_exact_load(real_kv_1k, codecs, on_device) -> None:
    """Lossless chunks (splitzip on the device, rans on the CPU) and lossy ones (int8 and int4, LOSSY: NOT BIT-EXACT
    vs the KV, dequantised by the kernel into the pages: bit-exact vs the CPU decoder): what the CPU fetcher writes."""
    from vllm_kvcodec.load.fetcher import Fetcher
    from vllm_kvcodec.tools import gpu_load_check as lc
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.paged import PackedKVLayout
    from vllm_kvcodec.stats import ConnectorStats

    sc = lc.build(real_kv_1k[:, :, : 256 * len(codecs)].contiguous(), chunk_size=256, layers_per_object=10,
                  block_size=16, codecs=codecs, first_token=37)
    caches = sc.caches("cuda")
    layouts = [PackedKVLayout(sc.geometry)] * len(caches)
    stats = ConnectorStats()
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, layouts, 4, stats)
    try:
        job = fetcher.submit(sc.specs, 60)
        for layer in range(len(caches)):
            assert job.wait_layer(layer, job.deadline)  # the compute stream now waits on the group's event
        assert all(e is not None for e in job.events)
        assert job.done.wait(60)
        job.settle()
        torch.cuda.current_stream().synchronize()
        assert not job.failed_blocks
        assert lc.caches_equal(caches, sc.expected())
        assert stats.totals()["gpu_decoded_objects"] == on_device  # 3 layer groups
        cpu = sc.caches("cpu")
        cpu_fetcher = Fetcher(sc.store, sc.addresses, cpu, layouts, 2, ConnectorStats())
        cpu_job = cpu_fetcher.submit(sc.specs, 60)
        assert cpu_job.done.wait(60)
        cpu_fetcher.shutdown()
        assert lc.caches_equal(caches, cpu)
    finally:
        fetcher.shutdown()


@pytest.mark.gpu
@cuda_kernels
def test_worker_picks_the_cuda_fetcher_for_cuda_caches() -> None:
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.connector.worker_half import _fetcher_class

    assert _fetcher_class([torch.zeros(1, device="cuda")]) is CudaFetcher


@pytest.mark.gpu
@cuda_kernels
def test_cuda_save_gather_reaches_the_store_bit_exact(real_kv_1k) -> None:
    from storage import open_store
    from vllm_kvcodec.save.codec_choice import CodecChooser
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.tools import gpu_load_check as lc
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.paged import PackedKVLayout
    from vllm_kvcodec.save.cuda_gather import CudaSaveGather
    from vllm_kvcodec.save.saver import Saver
    from vllm_kvcodec.stats import ConnectorStats

    sc = lc.build(real_kv_1k[:, :, :512].contiguous(), chunk_size=256, layers_per_object=10, block_size=16,
                  codecs=["splitzip"])
    caches = sc.caches("cuda", "HND")
    layouts = [PackedKVLayout(sc.geometry)] * len(caches)
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, layouts, 2, ConnectorStats())
    store = open_store("memory://cuda-save-gather")
    saver = Saver(store, sc.addresses, CodecChooser("splitzip"), 1, 1 << 30, ConnectorStats())
    try:
        job = fetcher.submit(sc.specs, 60)
        assert job.done.wait(60)
        job.settle()
        gather = CudaSaveGather(caches, layouts, saver)
        chunks = [c for spec in sc.specs for c in spec.chunks]
        lc.save_chunks(gather, caches, chunks)
        gather.shutdown()
        assert saver.flush(60)
        for chunk in chunks:
            c = sc.index[chunk.chunk_hash]
            for g, layers in enumerate(sc.addresses.groups):
                got = decode_chunk(store.get(sc.addresses.key(chunk.chunk_hash, g)))
                assert torch.equal(lc.bits(got), lc.bits(sc.kv[layers.start : layers.stop, :, c * 256 : (c + 1) * 256]))
    finally:
        saver.shutdown()
        fetcher.shutdown()


@pytest.mark.gpu
@cuda_kernels
def test_a_load_into_blocks_a_tail_gather_still_reads_lands_after_it(real_kv_1k) -> None:
    """Real streams: the save gather of a finishing tail (A's KV) is held back on its side stream by a sleep
    kernel; a load of other KV (B) into the same blocks is submitted on the load path's stream right after. The
    tail must be saved as A: the load's stream waits for the gather's event of those blocks."""
    from storage import open_store
    from vllm_kvcodec.save.codec_choice import CodecChooser
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.paged import PackedKVLayout
    from vllm_kvcodec.save.cuda_gather import CudaSaveGather
    from vllm_kvcodec.save.saver import Saver
    from vllm_kvcodec.stats import ConnectorStats
    from vllm_kvcodec.tools import gpu_load_check as lc

    kv_a = real_kv_1k[:, :, :512].contiguous()
    kv_b = (kv_a.view(torch.int16) ^ 0x0101).view(torch.bfloat16)  # other bits, the same shape
    a = lc.build(kv_a, chunk_size=256, layers_per_object=10, block_size=16, codecs=["raw"], first_token=0)
    b = lc.build(kv_b, chunk_size=256, layers_per_object=10, block_size=16, codecs=["raw"], first_token=0)
    assert [c.slots for s in a.specs for c in s.chunks] == [c.slots for s in b.specs for c in s.chunks]
    caches = a.caches("cuda", "HND")
    layouts = [PackedKVLayout(a.geometry)] * len(caches)
    store = open_store("memory://tail-then-load")
    saver = Saver(store, a.addresses, CodecChooser("raw"), 1, 1 << 30, ConnectorStats())
    fill = CudaFetcher(a.store, a.addresses, caches, layouts, 2, ConnectorStats())
    load = CudaFetcher(b.store, b.addresses, caches, layouts, 2, ConnectorStats())
    gather = CudaSaveGather(caches, layouts, saver)
    load.placement.block_reads = gather.block_reads  # as the worker half wires them
    try:
        job = fill.submit(a.specs, 60)  # the finished request's KV: A
        assert job.done.wait(60)
        job.settle()
        torch.cuda.synchronize()
        chunks = [c for spec in a.specs for c in spec.chunks]
        specs = [SimpleNamespace(req_id="tail", chunk_hash=c.chunk_hash, group_slots=[c.slots], tokens=len(c.slots))
                 for c in chunks]
        with gather.side.active():
            torch.cuda._sleep(1_000_000_000)  # a busy save stream: the gathers below start about half a second late
        for layer in range(len(caches)):
            gather.gather_layer(layer, caches[layer], specs)
        assert not gather.end_step(specs, lambda spec: True)
        job = load.submit(b.specs, 60)  # vLLM handed the freed blocks to another request's load (B)
        assert job.done.wait(60)
        job.settle()
        gather.flush()
        assert saver.flush(60)
        torch.cuda.synchronize()
        assert lc.caches_equal(caches, b.expected()), "the load landed"
        for chunk in chunks:
            c = a.index[chunk.chunk_hash]
            for g, layers in enumerate(a.addresses.groups):
                got = decode_chunk(store.get(a.addresses.key(chunk.chunk_hash, g)))
                want = kv_a[layers.start : layers.stop, :, c * 256 : (c + 1) * 256]
                assert torch.equal(lc.bits(got), lc.bits(want)), "the tail was saved with the load's KV"
    finally:
        gather.shutdown()
        saver.shutdown()
        fill.shutdown()
        load.shutdown()


@pytest.mark.gpu
@cuda_kernels
def test_cuda_fetcher_decodes_video_with_nvdec_bit_exact(real_kv_1k) -> None:
    """Where NVDEC works: video objects through reused NVDEC sessions, the device join and checksum, the scatter."""
    pytest.importorskip("av")  # x265 encodes the chunks
    from vllm_kvcodec.gpu import nvcodec
    from vllm_kvcodec.load.cuda_placement import CudaFetcher
    from vllm_kvcodec.paged import PackedKVLayout
    from vllm_kvcodec.stats import ConnectorStats
    from vllm_kvcodec.tools import gpu_load_check as lc

    ok, reason = nvcodec.nvdec_available()
    if not ok:
        pytest.skip(reason)
    sc = lc.build(real_kv_1k[:, :, :512].contiguous(), chunk_size=256, layers_per_object=10, block_size=16,
                  codecs=["video", "splitzip"], first_token=37)
    caches = sc.caches("cuda")
    stats = ConnectorStats()
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, [PackedKVLayout(sc.geometry)] * len(caches), 4, stats)
    try:
        job = fetcher.submit(sc.specs, 60)
        assert job.done.wait(60)
        job.settle()
        torch.cuda.current_stream().synchronize()
        assert not job.failed_blocks and lc.caches_equal(caches, sc.expected())
        assert fetcher.placement.nvdec.unavailable is None
        assert stats.totals()["gpu_decoded_objects"] == 6  # 3 groups x (1 video + 1 splitzip chunk)
    finally:
        fetcher.shutdown()
