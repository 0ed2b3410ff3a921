"""GPU load/save path on CPU tensors in Triton's interpreter: run by tests/gpu/test_gpu_load.py in a child process.

Not collected by itself (the name does not start with ``test_``): the
interpreter needs ``TRITON_INTERPRET=1`` before triton is first imported, so
``test_gpu_load.py`` runs this file in a child ``pytest`` with the variable
set there only. Every result is compared bit for bit with the CPU path
(:class:`~vllm_kvcodec.paged.PackedKVLayout`, :class:`~vllm_kvcodec.load.fetcher.Fetcher`).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from storage import open_store
from vllm_kvcodec.save.codec_choice import CodecChooser
from vllm_kvcodec.load.fetcher import Fetcher
from vllm_kvcodec.format import decode_chunk, encode_chunk
from vllm_kvcodec.tools import gpu_load_check as lc
from vllm_kvcodec.load.cuda_placement import CudaFetcher
from vllm_kvcodec.gpu.launch import interpreted
from vllm_kvcodec.gpu.side_stream import SideStream
from vllm_kvcodec.gpu.scatter_triton import PackedPages
from vllm_kvcodec.paged import Geometry, PackedKVLayout, PagedLayoutError, SlotError
from vllm_kvcodec.save.saver import Saver
from vllm_kvcodec.save.cuda_gather import CudaSaveGather
from vllm_kvcodec.stats import ConnectorStats

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def test_this_process_interprets() -> None:
    assert interpreted(), "run with TRITON_INTERPRET=1 (tests/gpu/test_gpu_load.py does)"


def _garbage(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs with payloads included): a write in the wrong place cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(int_dtype)
    return torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=gen).view(dtype)


def _layer_caches(layers: int, blocks: int, heads: int, block: int, head: int, dtype: torch.dtype,
                  order: str, seed: int = 0) -> list[torch.Tensor]:
    """Logical [blocks, heads, block, 2*head] views of one allocation, in vLLM 0.33's physical orders."""
    if order == "NHD":  # LBNHC: tokens before heads
        whole = _garbage((layers, blocks, block, heads, 2 * head), dtype, seed)
        return [whole[i].transpose(1, 2) for i in range(layers)]
    if order == "HND":  # LBHNC
        whole = _garbage((layers, blocks, heads, block, 2 * head), dtype, seed)
        return [whole[i] for i in range(layers)]
    if order == "block-outer":  # BLNHC: layers interleaved inside each block
        whole = _garbage((blocks, layers, block, heads, 2 * head), dtype, seed)
        return [whole[:, i].transpose(1, 2) for i in range(layers)]
    raise ValueError(order)


def _kv_from_real(real: torch.Tensor, layers: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    kv = real[:layers, :, :tokens]
    if dtype == torch.float16:  # bf16 -> fp16 is lossy, so take real fp16 bit patterns from the bf16 ones
        return kv.contiguous().view(torch.int16).view(torch.float16)
    return kv.to(dtype).contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return lc.bits(t)


def _odd_slots(num_blocks: int, block: int, tokens: int, seed: int, first: int = 3) -> torch.Tensor:
    """Shuffled, non-contiguous blocks, starting ``first`` tokens into the first block (a partial block)."""
    gen = torch.Generator().manual_seed(seed)
    need = -(-(tokens + first) // block)
    table = torch.randperm(num_blocks, generator=gen)[:need]
    pos = torch.arange(first, first + tokens)
    return table[pos // block] * block + pos % block


@pytest.mark.parametrize("order", ["NHD", "HND", "block-outer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_scatter_and_gather_match_the_layout(real_chunks, order, dtype) -> None:
    layers, heads, head, block, blocks, tokens = 3, 3, 64, 16, 12, 37
    kv_full = _kv_from_real(real_chunks[1], layers, 45, dtype)
    kv = kv_full[:, :, 5 : 5 + tokens]  # a token slice of a chunk: what a partial first block loads
    slots = _odd_slots(blocks, block, tokens, seed=7)
    got = _layer_caches(layers, blocks, heads, block, head, dtype, order)
    want = [c.clone() for c in got]
    layout = PackedKVLayout(Geometry(heads, head, block, dtype))
    PackedPages(got, head).scatter(0, kv, slots)
    for i in range(layers):
        layout.scatter(want[i], slots, kv[i].contiguous())
    for i in range(layers):  # every byte, also those no slot addresses
        assert torch.equal(_bits(got[i]), _bits(want[i])), f"layer {i}"
    out = torch.empty((layers, 2, tokens, heads, head), dtype=dtype)
    PackedPages(got, head).gather(0, slots, out)
    for i in range(layers):
        assert torch.equal(_bits(out[i]), _bits(layout.gather(want[i], slots)))
    assert torch.equal(_bits(out), _bits(kv))


def test_scatter_keeps_nan_payloads_and_odd_head_size() -> None:
    """Bits move as integers (NaN payloads survive); head_size 80 is not a power of two; one-token slot lists."""
    layers, heads, head, block, blocks = 2, 2, 80, 8, 6
    kv = _garbage((layers, 2, 11, heads, head), torch.bfloat16, seed=3)
    got = _layer_caches(layers, blocks, heads, block, head, torch.bfloat16, "NHD", seed=4)
    want = [c.clone() for c in got]
    layout = PackedKVLayout(Geometry(heads, head, block, torch.bfloat16))
    pages = PackedPages(got, head)
    slots = torch.tensor([47, 0, 9, 8, 31, 30, 17, 5, 40, 23, 1])
    pages.scatter(0, kv, slots)
    pages.scatter(1, kv[1:, :, :1], torch.tensor([44]))  # one token, second layer only
    for i in range(layers):
        layout.scatter(want[i], slots, kv[i].contiguous())
    layout.scatter(want[1], torch.tensor([44]), kv[1, :, :1].contiguous())
    for i in range(layers):
        assert torch.equal(_bits(got[i]), _bits(want[i]))


def test_pages_refuse_what_they_cannot_address() -> None:
    caches = _layer_caches(2, 4, 2, 8, 16, torch.bfloat16, "HND")
    with pytest.raises(PagedLayoutError, match="differs from layer 0"):
        PackedPages([caches[0], caches[1][:3]], 16)
    pages = PackedPages(caches, 16)
    kv = torch.zeros(1, 2, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(PagedLayoutError, match="layers"):
        pages.scatter(2, kv, torch.arange(4))
    with pytest.raises(SlotError):
        pages.scatter(0, kv, torch.arange(3))
    with pytest.raises(PagedLayoutError, match="float16"):
        pages.scatter(0, kv.to(torch.float16), torch.arange(4))
    with pytest.raises(PagedLayoutError):
        PackedPages(caches, 8)  # the content axis is not 2 * head_size
    strided = torch.zeros(4, 32, 2, 8, dtype=torch.bfloat16).permute(0, 2, 3, 1)  # content axis not contiguous
    with pytest.raises(PagedLayoutError, match="contiguous"):
        PackedPages([strided], 16)


# ---- the load pipeline ------------------------------------------------------------------------------


def _scenario(real_kv_1k, codecs, *, first_token=5, seed=0):
    kv = real_kv_1k[:4, :, :64].contiguous()  # 4 layers, 4 chunks of 16 tokens, blocks of 8
    return lc.build(kv, chunk_size=16, layers_per_object=2, block_size=8, codecs=codecs,
                    first_token=first_token, seed=seed)


def _layouts(sc):
    return [PackedKVLayout(sc.geometry)] * sc.kv.shape[0]


def _run(fetcher_cls, sc, caches, stats=None, timeout=120.0):
    fetcher = fetcher_cls(sc.store, sc.addresses, caches, _layouts(sc), 2, stats or ConnectorStats(),
                          variants=sc.variants)
    try:
        job = fetcher.submit(sc.specs, timeout)
        for layer in range(len(caches)):
            assert job.wait_layer(layer, job.deadline)
        assert job.done.wait(timeout)
        job.settle()
        return job
    finally:
        fetcher.shutdown()


@pytest.mark.parametrize("order", lc.ORDERS)
def test_gpu_fetcher_writes_what_the_cpu_fetcher_writes(real_kv_1k, order) -> None:
    sc = _scenario(real_kv_1k, ["splitzip", "raw", "rans", "splitzip"])
    gpu, cpu = sc.caches("cpu", order), sc.caches("cpu", order)
    stats = ConnectorStats()
    job = _run(CudaFetcher, sc, gpu, stats)
    _run(Fetcher, sc, cpu)
    assert not job.failed_blocks
    assert lc.caches_equal(gpu, cpu)
    assert lc.caches_equal(gpu, sc.expected())
    totals = stats.totals()
    assert totals["gpu_decoded_objects"] == 4  # 2 splitzip chunks x 2 layer groups decoded by the kernels
    assert totals["loaded_objects"] == 8 and totals["loaded_tokens"] == 64 - 2 * 5


def test_gpu_fetcher_falls_back_to_the_layouts_for_other_strides(real_kv_1k) -> None:
    """Caches the pointer-table kernel does not take (content axis not contiguous) load through the layouts."""
    sc = _scenario(real_kv_1k, ["splitzip", "raw"], seed=5)
    layers, _, _, heads, head = sc.kv.shape
    whole = torch.zeros(layers, sc.num_blocks, 2 * head, heads, sc.block_size, dtype=sc.kv.dtype)
    caches = [whole[i].permute(0, 2, 3, 1) for i in range(layers)]  # logical [blocks, heads, block, 2*head]
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, _layouts(sc), 1, ConnectorStats())
    assert fetcher.pages is None
    fetcher.shutdown()
    job = _run(CudaFetcher, sc, caches)
    assert not job.failed_blocks
    assert lc.caches_equal(caches, sc.expected())


def test_gpu_fetcher_reports_failed_objects_and_never_writes_them(real_kv_1k) -> None:
    sc = _scenario(real_kv_1k, ["splitzip"], seed=1)
    chunks = [c for spec in sc.specs for c in spec.chunks]
    key = sc.addresses.key
    sc.store.delete(key(chunks[0].chunk_hash, 0))  # missing
    blob = sc.store.get(key(chunks[1].chunk_hash, 1))
    sc.store.put(key(chunks[1].chunk_hash, 1), blob[:-9] + bytes([blob[-9] ^ 1]) + blob[-8:])  # checksum fails
    sc.store.put(key(chunks[2].chunk_hash, 0), lc.swap_escape_positions(sc.store.get(key(chunks[2].chunk_hash, 0)), key(chunks[2].chunk_hash, 0)))
    gpu = sc.caches("cpu")
    _failed_exactly(sc, _run(CudaFetcher, sc, gpu), gpu, [(chunks[0], 0), (chunks[1], 1), (chunks[2], 0)])


def _failed_exactly(sc, job, gpu, damaged) -> None:
    """The objects ``damaged`` ((chunk, group) pairs) failed, exactly their blocks, as the CPU fetcher decides, and
    nothing of theirs was written (everything else was)."""
    cpu = sc.caches("cpu")
    cpu_job = _run(Fetcher, sc, cpu)
    assert job.failed_blocks == {b for chunk, _ in damaged for b in chunk.block_ids} == cpu_job.failed_blocks
    assert lc.caches_equal(gpu, sc.expected({(chunk.chunk_hash, g) for chunk, g in damaged}))
    assert lc.caches_equal(gpu, cpu)


def test_gpu_fetcher_refuses_objects_of_another_shape(real_kv_1k) -> None:
    sc = _scenario(real_kv_1k, ["splitzip"], seed=2)
    chunk = sc.specs[0].chunks[0]
    wrong = encode_chunk(sc.kv[:2, :, :8].contiguous(), "splitzip", key=sc.addresses.key(chunk.chunk_hash, 1))  # 8 tokens, not 16
    sc.store.put(sc.addresses.key(chunk.chunk_hash, 1), wrong)
    gpu = sc.caches("cpu")
    job = _run(CudaFetcher, sc, gpu)
    assert job.failed_blocks == set(chunk.block_ids)
    assert lc.caches_equal(gpu, sc.expected({(chunk.chunk_hash, 1)}))


class _GatedStore:
    """The real memory store, but gets of one layer group wait for a gate (a slow link, deterministically)."""

    def __init__(self, store, group_suffix: str) -> None:
        self.store, self.suffix, self.gate = store, group_suffix, threading.Event()

    def get_many(self, keys: list[str]):
        if any(key.endswith(self.suffix) for key in keys):
            self.gate.wait(30)
        return self.store.get_many(keys)


def test_gpu_fetcher_cancel_writes_nothing_late(real_kv_1k) -> None:
    sc = _scenario(real_kv_1k, ["splitzip"], seed=3)
    gated = _GatedStore(sc.store, "g001")
    caches = sc.caches("cpu")
    fetcher = CudaFetcher(gated, sc.addresses, caches, _layouts(sc), 2, ConnectorStats())
    try:
        job = fetcher.submit(sc.specs, 120)
        assert job.wait_layer(0, job.deadline)  # group 0 arrives
        assert not job.wait_layer(2, time.monotonic() + 0.3)  # group 1 is held at the gate
        job.cancel()
        gated.gate.set()
        fetcher.shutdown()  # the held threads finish: they must not write
        all_blocks = {b for spec in sc.specs for c in spec.chunks for b in c.block_ids}
        assert job.failed_blocks == all_blocks
        group1 = {(c.chunk_hash, 1) for spec in sc.specs for c in spec.chunks}
        assert lc.caches_equal(caches, sc.expected(group1))
    finally:
        gated.gate.set()
        fetcher.shutdown()


# ---- the save path's gather -------------------------------------------------------------------------


def test_save_gather_hands_the_saver_what_the_cpu_gather_would(real_kv_1k) -> None:
    sc = _scenario(real_kv_1k, ["raw"], first_token=0, seed=4)
    caches = sc.caches("cpu", "NHD")
    _run(CudaFetcher, sc, caches)  # fill the caches with the scenario's KV
    store = open_store("memory://save-gather")
    stats = ConnectorStats()
    saver = Saver(store, sc.addresses, CodecChooser("splitzip"), 1, 1 << 30, stats)
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, _layouts(sc), 1, ConnectorStats())
    gather = CudaSaveGather(caches, _layouts(sc), saver)
    chunks = [c for spec in sc.specs for c in spec.chunks]
    lc.save_chunks(gather, caches, chunks)
    assert saver.flush(60)
    for chunk in chunks:
        c = sc.index[chunk.chunk_hash]
        for g, layers in enumerate(sc.addresses.groups):
            got = decode_chunk(store.get(sc.addresses.key(chunk.chunk_hash, g)))
            want = sc.kv[layers.start : layers.stop, :, c * 16 : (c + 1) * 16]
            assert torch.equal(_bits(got), _bits(want))
    assert stats.totals()["saved_chunks"] == len(chunks)
    gather.shutdown()
    saver.shutdown()
    fetcher.shutdown()


# ---- video objects: NVDEC's place in the load path (the PyNvVideoCodec 2.0.4 stand-in, libav behind it) ----------


class _Mark:
    """Stands in for a CUDA event, which a CPU device has none of."""

    def __init__(self, n: int) -> None:
        self.n, self.done = n, False

    def query(self) -> bool:
        return self.done


class _MarkedSide(SideStream):
    """The CPU side stream, with a mark per ``record`` where CUDA would record an event, and every wait logged in
    order with the records: what the ordering logic decides, checked without a GPU (a GPU runs it for real)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.log: list[tuple[str, object]] = []

    def record(self):
        mark = _Mark(len(self.log))
        self.log.append(("record", mark))
        return mark

    @staticmethod
    def host_wait(event) -> None:
        pass

    def compute_waits(self, event) -> None:
        pass

    def side_waits_for(self, events) -> None:
        self.log.append(("side waits for", list(events)))


def test_a_load_first_waits_for_the_save_gathers_that_read_its_blocks(real_kv_1k) -> None:
    """req-0's tail is gathered (its blocks then freed, as vLLM frees a finished request's); a load into req-1's
    blocks waits for nothing, a load into req-0's blocks for the gather's end-of-step event, before it records
    anything of its own on its stream; once that event has passed, nothing."""
    sc = _scenario(real_kv_1k, ["raw"], first_token=0, seed=5)
    caches = sc.caches("cpu", "NHD")
    saver = Saver(open_store("memory://block-reads"), sc.addresses, CodecChooser("raw"), 1, 1 << 30, ConnectorStats())
    gather = CudaSaveGather(caches, _layouts(sc), saver)
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, _layouts(sc), 1, ConnectorStats())
    gather.side, fetcher.placement.side = _MarkedSide(), _MarkedSide()
    fetcher.placement.block_reads = gather.block_reads  # as the worker half wires them
    tail, other = sc.specs  # two requests on blocks of their own
    assert not {b for c in tail.chunks for b in c.block_ids} & {b for c in other.chunks for b in c.block_ids}

    def load(spec) -> list:
        side = fetcher.placement.side
        side.log.clear()
        job = fetcher.submit([spec], 120)
        assert job.done.wait(120)
        job.settle()
        assert side.log[0][0] == "side waits for", "a load enqueued work before it waited"
        assert any(what == "record" for what, _ in side.log[1:])
        return side.log[0][1]

    try:
        lc.save_chunks(gather, caches, tail.chunks)
        assert saver.flush(60)
        step_end = gather.side.log[-1][1]  # the end of the step: what the engine's stream waits for, too
        assert load(other) == []
        assert load(tail) == [step_end]
        step_end.done = True
        assert load(tail) == [] and len(gather.block_reads) == 0
    finally:
        gather.shutdown()
        saver.shutdown()
        fetcher.shutdown()


# ---- video objects: NVDEC's place in the load path (libav standing in for the decoder session) -------------

from vllm_kvcodec.format.device_chunks import parse_video_payload  # noqa: E402
from vllm_kvcodec.format import build_chunk, read_header  # noqa: E402
from vllm_kvcodec.gpu.nvdec_join_triton import READBACK_BYTES, exponent_digest_into, finish_xxh3, join_exponents  # noqa: E402
from vllm_kvcodec.gpu.nvdec_sessions import NvdecSessions  # noqa: E402
from vllm_kvcodec.tools.gpu_nvc_stand_in import LibavPictures, StandInNvc  # noqa: E402


def _stand_in(**options) -> NvdecSessions:
    """The product's NVDEC sessions over the stand-in of PyNvVideoCodec 2.0.4."""
    return NvdecSessions(StandInNvc(**options))


_DEFAULT = object()


def _video_run(sc, caches, stats=None, sessions=_DEFAULT, timeout=120.0, threads=2):
    fetcher = CudaFetcher(sc.store, sc.addresses, caches, _layouts(sc), threads, stats or ConnectorStats(),
                          video_sessions=_stand_in() if sessions is _DEFAULT else sessions)
    try:
        job = fetcher.submit(sc.specs, timeout)
        assert job.done.wait(timeout)
        job.settle()
        return job, fetcher
    finally:
        fetcher.shutdown()


def test_join_and_checksum_kernels_match_the_cpu() -> None:
    """The device join equals video.join; the device XXH3 accumulators finish to xxhash's digest, for short and
    long inputs, whole and partial 1 KiB blocks."""
    import xxhash
    from vllm_kvcodec.codecs.video_layout import geometry, to_planes

    gen = torch.Generator().manual_seed(11)
    for shape in [(1, 1, 3), (2, 2, 5, 3, 16), (1, 2, 16, 3, 64), (3, 2, 7, 2, 24)]:
        bits = torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=gen)
        flat = bits.view(-1).numpy().view("<u2")
        exps = ((flat >> 7) & 0xFF).astype("u1")
        signman = (((flat >> 8) & 0x80) | (flat & 0x7F)).astype("u1")
        geo = geometry(shape)
        planes = torch.from_numpy(to_planes(exps, geo))
        out = torch.empty(geo.n, dtype=torch.int16)
        join_exponents(planes, torch.from_numpy(signman), geo, out)
        assert torch.equal(out, bits.view(-1)), shape
        back = torch.zeros(READBACK_BYTES, dtype=torch.uint8)
        exponent_digest_into(out, back)
        assert finish_xxh3(back.numpy().tobytes(), geo.n) == xxhash.xxh3_64_intdigest(exps.tobytes()), shape


def test_value_digest_kernel_matches_the_format() -> None:
    """One program per segment on the device gives the chunk format's value digest (vllm_kvcodec.format), for inputs
    short and long, one segment or many, with a short tail joined to the segment before or not."""
    from vllm_kvcodec.format import value_digest
    from vllm_kvcodec.gpu.value_digest_triton import finish_value_digest, readback_bytes, value_digest_into

    gen = torch.Generator().manual_seed(12)
    for nbytes, segment in [(1, 1024), (240, 1024), (241, 1024), (1024, 1024), (1264, 1024), (1265, 1024),
                            (5000, 1024), (3 * 4096 + 241, 4096), (40001, 16384)]:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        back = torch.zeros(readback_bytes(nbytes, segment), dtype=torch.uint8)
        value_digest_into(data, segment, back)
        got = finish_value_digest(back.numpy().tobytes(), nbytes, segment)
        assert got == value_digest(data.numpy().tobytes(), segment), (nbytes, segment)


def _video_scenario(real_kv_1k, codecs=("video", "splitzip"), seed=20, first_token=5):
    pytest.importorskip("av")
    return _scenario(real_kv_1k, list(codecs), seed=seed, first_token=first_token)


def test_gpu_fetcher_decodes_video_objects_bit_exactly(real_kv_1k) -> None:
    sc = _video_scenario(real_kv_1k)
    gpu, cpu = sc.caches("cpu"), sc.caches("cpu")
    stats = ConnectorStats()
    sessions = _stand_in()
    job, fetcher = _video_run(sc, gpu, stats, sessions)
    _run(Fetcher, sc, cpu)
    assert not job.failed_blocks
    assert lc.caches_equal(gpu, cpu) and lc.caches_equal(gpu, sc.expected())
    totals = stats.totals()
    assert totals["gpu_decoded_objects"] == 8 and totals["codec_video_loads"] == 4  # video and splitzip: all on the device
    assert 1 <= len(sessions.nvc.decoders) <= 2  # 4 video objects of one size, 2 fetch threads: sessions reused
    assert fetcher.placement.nvdec.unavailable is None


def _rewrap(sc, chunk, group, change) -> None:
    """Store ``change(payload)`` in place of an object's payload, under a valid checksum and key binding."""
    key = sc.addresses.key(chunk.chunk_hash, group)
    blob = sc.store.get(key)
    head = read_header(blob, key=key)
    payload = bytearray(memoryview(blob)[head.payload_offset : head.payload_offset + head.payload_length])
    sc.store.put(key, build_chunk(bytes(change(payload, head)), head.dtype, head.shape, head.codec_config, key=key))


def _stream_at(payload: bytearray, head) -> int:
    parsed = parse_video_payload(bytes(payload), head.shape)
    return len(payload) - len(parsed.stream)


def test_gpu_fetcher_fails_damaged_video_objects_and_writes_nothing(real_kv_1k) -> None:
    sc = _video_scenario(real_kv_1k, codecs=("video",), seed=21)
    chunks = [c for spec in sc.specs for c in spec.chunks]

    def damage_stream(payload, head):  # bytes in the middle of the slice data
        at = _stream_at(payload, head)
        mid = at + (len(payload) - at) // 2
        payload[mid : mid + 4] = bytes(b ^ 0xFF for b in payload[mid : mid + 4])
        return payload

    def wrong_sizes(payload, head):  # packet table no longer sums to the stream
        parsed = parse_video_payload(bytes(payload), head.shape)
        at = _stream_at(payload, head) - 4 * parsed.frames
        payload[at] ^= 1
        return payload

    def wrong_exponent_hash(payload, head):  # decodes fine, to exponents that are not the ones hashed
        payload[8] ^= 1
        return payload

    _rewrap(sc, chunks[0], 0, damage_stream)
    _rewrap(sc, chunks[1], 1, wrong_sizes)
    _rewrap(sc, chunks[2], 0, wrong_exponent_hash)
    gpu = sc.caches("cpu")
    _failed_exactly(sc, _video_run(sc, gpu)[0], gpu, [(chunks[0], 0), (chunks[1], 1), (chunks[2], 0)])


class _ConcealingPictures(LibavPictures):
    """A decoder that returns every picture with one exponent changed (what concealment would do)."""

    def __call__(self, packet: bytes):
        picture = super().__call__(packet)
        if picture is not None:
            picture = picture.copy()
            picture[0, 0, 0] ^= 1
        return picture


@pytest.mark.parametrize("digest", ["value digest", "exponent hash"])
def test_device_checksum_catches_a_decoder_that_lies(real_kv_1k, digest: str) -> None:
    """Both checks a video object may carry catch it on the device: the value digest (new chunks) and the payload's
    exponent hash (chunks written before the value digest)."""
    sc = _video_scenario(real_kv_1k, codecs=("video",), seed=22)
    if digest == "exponent hash":  # rewrap each object without its value digest, as an older writer stored it
        for spec in sc.specs:
            for chunk in spec.chunks:
                for group in range(len(sc.addresses.groups)):
                    _rewrap(sc, chunk, group, lambda payload, head: payload)
    gpu = sc.caches("cpu")
    job, _ = _video_run(sc, gpu, sessions=NvdecSessions(StandInNvc(pictures=_ConcealingPictures)))
    every = {b for spec in sc.specs for c in spec.chunks for b in c.block_ids}
    assert job.failed_blocks == every
    assert lc.caches_equal(gpu, sc.caches("cpu"))  # nothing written


def test_without_nvdec_video_objects_decode_on_the_cpu_logged_once(real_kv_1k, caplog) -> None:
    """On a device without NVDEC (here: a CPU) the default sessions give up once, and the CPU codec decodes."""
    sc = _video_scenario(real_kv_1k, seed=23)
    gpu = sc.caches("cpu")
    stats = ConnectorStats()
    with caplog.at_level("INFO", logger="vllm_kvcodec"):
        job, fetcher = _video_run(sc, gpu, stats, sessions=None)
    assert not job.failed_blocks and lc.caches_equal(gpu, sc.expected())
    assert fetcher.placement.nvdec.unavailable
    assert sum("NVDEC unavailable" in r.getMessage() for r in caplog.records) == 1
    assert stats.totals()["gpu_decoded_objects"] == 4  # the splitzip ones only


@pytest.mark.parametrize("engines,threads,want", [(3, 4, 3), (7, 4, 4)])
def test_session_pool_is_sized_from_the_engines_whatever_the_factory(real_kv_1k, engines, threads, want) -> None:
    """min(NVDEC engines, fetch threads), the engines from the factory's library caps (issue 43, item 1: a given
    factory left the size unset and the pool held one session)."""
    sc = _video_scenario(real_kv_1k, codecs=("video",), seed=26)
    gpu = sc.caches("cpu")
    job, fetcher = _video_run(sc, gpu, sessions=_stand_in(engines=engines), threads=threads)
    assert not job.failed_blocks and lc.caches_equal(gpu, sc.expected())
    assert fetcher.placement.nvdec.sessions == want


def test_gpu_fetcher_decodes_objects_of_two_picture_sizes(real_kv_1k) -> None:
    """5 layers in objects of 4: the last group's object has 1 layer, so its pictures are shorter (144 rows, the
    others 176). Each size gets its own decoder (a 2.0.4 decoder scales a smaller picture to its first size and
    refuses a larger one): every object bit-exact, no decoder ever handed a second size."""
    pytest.importorskip("av")
    kv = real_kv_1k[:5, :, :128].contiguous()
    sc = lc.build(kv, chunk_size=64, layers_per_object=4, block_size=16, codecs=["video"], first_token=0, seed=27)
    gpu = sc.caches("cpu")
    sessions = _stand_in()
    job, fetcher = _video_run(sc, gpu, sessions=sessions, threads=2)
    assert not job.failed_blocks and lc.caches_equal(gpu, sc.expected())
    heights = {d.size for d in sessions.nvc.decoders}
    assert heights == {(192, 176), (192, 144)}
    assert all(c["maxheight"] in (144, 176) for c in sessions.nvc.create_calls)


def test_unsupported_turns_nvdec_off_once_and_the_cpu_decodes(real_kv_1k, caplog) -> None:
    """A PyNvVCExceptionUnsupported from Decode (codec or size this GPU cannot decode) is not damage: NVDEC is turned
    off once, logged, and every video object decodes on the CPU instead of failing."""
    sc = _video_scenario(real_kv_1k, seed=28)
    gpu = sc.caches("cpu")
    with caplog.at_level("INFO", logger="vllm_kvcodec"):
        job, fetcher = _video_run(sc, gpu, sessions=_stand_in(unsupported=True))
    assert not job.failed_blocks and lc.caches_equal(gpu, sc.expected())
    assert "PyNvVCExceptionUnsupported" in fetcher.placement.nvdec.unavailable
    assert sum("NVDEC unavailable" in r.getMessage() for r in caplog.records) == 1


def test_splitzip_objects_with_a_value_digest_are_checked_on_the_device(real_kv_1k) -> None:
    """SplitZip chunks that carry a value digest: decoded by the kernels, digested on the device; a chunk whose
    digest disagrees with its (valid) payload fails before anything is written."""
    from vllm_kvcodec.format import ValueDigest, value_digest

    sc = _scenario(real_kv_1k, ["splitzip"], seed=29)
    chunks = [c for spec in sc.specs for c in spec.chunks]
    for i, chunk in enumerate(chunks):
        key = sc.addresses.key(chunk.chunk_hash, 0)
        head = read_header(sc.store.get(key), key=key)
        at = sc.index[chunk.chunk_hash] * sc.chunk_size
        values = sc.kv[0:2, :, at : at + sc.chunk_size].contiguous().view(torch.int16).numpy().tobytes()
        digest = value_digest(values, 1024) ^ (i == 1)
        blob = sc.store.get(key)
        payload = memoryview(blob)[head.payload_offset : head.payload_offset + head.payload_length]
        sc.store.put(key, build_chunk(payload, head.dtype, head.shape, head.codec_config, key=key,
                                      value_digest=ValueDigest(1024, digest)))
    gpu = sc.caches("cpu")
    stats = ConnectorStats()
    job = _run(CudaFetcher, sc, gpu, stats)
    assert job.failed_blocks == set(chunks[1].block_ids)
    assert lc.caches_equal(gpu, sc.expected({(chunks[1].chunk_hash, 0)}))
    assert stats.totals()["gpu_decoded_objects"] == 2 * len(chunks) - 1


def test_gpu_fetcher_cancel_with_video_objects_writes_nothing_late(real_kv_1k) -> None:
    sc = _video_scenario(real_kv_1k, seed=24)
    gated = _GatedStore(sc.store, "g001")
    caches = sc.caches("cpu")
    fetcher = CudaFetcher(gated, sc.addresses, caches, _layouts(sc), 2, ConnectorStats(), video_sessions=_stand_in())
    try:
        job = fetcher.submit(sc.specs, 120)
        assert job.wait_layer(0, job.deadline)
        assert not job.wait_layer(2, time.monotonic() + 0.3)
        job.cancel()
        gated.gate.set()
        fetcher.shutdown()
        group1 = {(c.chunk_hash, 1) for spec in sc.specs for c in spec.chunks}
        assert job.failed_blocks == {b for spec in sc.specs for c in spec.chunks for b in c.block_ids}
        assert lc.caches_equal(caches, sc.expected(group1))
    finally:
        gated.gate.set()
        fetcher.shutdown()


def test_warm_up_compiles_without_changing_the_caches(real_kv_1k) -> None:
    """The main-thread warm-up gathers and scatters back the same bits: every cache byte is unchanged."""
    from vllm_kvcodec.load.cuda_placement import CudaPlacement

    sc = _scenario(real_kv_1k, ["raw"], seed=25)
    caches = [c.normal_() for c in sc.caches("cpu")]
    before = [c.clone() for c in caches]
    placement = CudaPlacement(caches, _layouts(sc), 1)
    assert placement.pages is not None  # the gather/scatter part runs
    placement._warm((2, 2, 16, 3, 64), 16)  # what warm() runs on CUDA (skipped in the interpreter)
    assert lc.caches_equal(caches, before)


def test_slots_are_checked_against_their_own_groups_cache() -> None:
    """Two KV cache groups with different block counts: a slot valid in group 0 is out of range in group 1."""
    from vllm_kvcodec.load.cuda_placement import CudaPlacement
    from vllm_kvcodec.plans.spans import Span

    geo = Geometry(2, 16, 8, torch.bfloat16)
    big = torch.zeros(10, 2, 8, 32, dtype=torch.bfloat16)
    small = torch.zeros(4, 2, 8, 32, dtype=torch.bfloat16)
    placement = CudaPlacement([big, small], [PackedKVLayout(geo)] * 2, 1, cache_groups=[0, 1])
    assert placement.group_slots == {0: 80, 1: 32}
    assert placement._checked_slots([Span(0, [79]), Span(0, [31])]) == [79, 31]
    with pytest.raises(SlotError):
        placement._checked_slots([Span(0, [31]), Span(0, [40])])


# ---- lossy quantized objects: dequantised into the pages by the kernel (LOSSY: NOT BIT-EXACT vs the KV; the
# dequantisation is, bit for bit, the reference CPU decode's) ---------------------------------------------------

import numpy as np  # noqa: E402

from vllm_kvcodec.codecs.dtypes import DType  # noqa: E402
from vllm_kvcodec.errors import CodecError  # noqa: E402
from vllm_kvcodec.codecs.precision import Precision  # noqa: E402
from vllm_kvcodec.format.device_quantized import StagedQuantized, unpack_quantized  # noqa: E402
from vllm_kvcodec.tools.gpu_integer_video import (  # noqa: E402
    IntegerCheck, decode_integer_planes, integer_geometry, integer_planes, integer_shape)
from vllm_kvcodec.gpu.dequant_triton import dequantize_into_pages  # noqa: E402

_LOSSY = [Precision("int8"), Precision("int6"), Precision("int4"), Precision("int4", sink_tokens=5, full_layers=1)]


def _staged(blob: bytes, with_integers: bool = True):
    head = read_header(blob)
    codec, parts = unpack_quantized(blob, head)
    return StagedQuantized.of(codec, parts, head, with_integers), head


def _on_cpu(staged: StagedQuantized, integers=None):
    """The staged bytes in a fresh (16-byte aligned) buffer, viewed as the kernel's input: the H2D copy, on a CPU."""
    buf = torch.zeros(staged.nbytes, dtype=torch.uint8)
    staged.write(buf)
    return staged.on_device(buf, integers)


def _reference_pages(blob: bytes, caches, slots, first: int, layer0: int = 0) -> list[torch.Tensor]:
    """The CPU decoder's values (the reference dequantisation) through the CPU page layout: what must land."""
    want = [c.clone() for c in caches]
    ref = decode_chunk(blob)
    layout = PackedKVLayout(Geometry(ref.shape[3], ref.shape[4], caches[0].shape[2], ref.dtype))
    for i in range(ref.shape[0]):
        layout.scatter(want[layer0 + i], slots, ref[i, :, first : first + slots.numel()].contiguous())
    return want


@pytest.mark.parametrize("precision", _LOSSY, ids=lambda p: f"{p.name}-sink{p.sink_tokens}-full{p.full_layers}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dequantize_scatter_writes_the_reference_bit_for_bit(real_chunks, precision, dtype) -> None:
    """Real KV quantised at each level: the kernel's pages equal the reference CPU decode scattered by the layout,
    every byte (the untouched ones pre-filled with random bits), for a token slice from a partial first block into
    shuffled blocks, the object's layers from the second cached layer on."""
    layers, heads, head, block, blocks, tokens, first = 3, 3, 64, 8, 12, 40, 3
    kv = _kv_from_real(real_chunks[2], layers, tokens, dtype)
    blob = encode_chunk(kv, precision=precision)
    staged, _ = _staged(blob)
    caches = _layer_caches(layers + 1, blocks, heads, block, head, dtype, "HND", seed=6)
    slots = _odd_slots(blocks, block, tokens - first - 2, seed=8)  # tokens [3, 38) of the object
    want = _reference_pages(blob, caches, slots, first, layer0=1)
    dequantize_into_pages(PackedPages(caches, head), 1, _on_cpu(staged), first, slots)
    for i, (got, ref) in enumerate(zip(caches, want)):
        assert torch.equal(_bits(got), _bits(ref)), f"layer {i}"


def test_dequantize_rounds_as_the_reference_where_shortcuts_differ() -> None:
    """float32 outputs whose product needs more than 24 bits (one fused rounding gives other bits than the
    reference's two), and bfloat16 outputs exactly half-way between two bfloat16 values (to nearest even; the
    interpreter's own float32 -> bfloat16 cast rounds them up): the kernel writes the reference's bits."""
    q = np.full((1, 2, 1, 16), 255, np.uint8)
    step = (1 + np.arange(1, 17) * 2.0**-23).astype(np.float32).reshape(1, 1, 16)  # 255 * step: 32 bits
    minimum = np.full((1, 1, 16), -255.0, np.float32)  # cancels all but the bits the product's rounding drops
    fused = (255 * step.astype(np.float64) - 255).astype(np.float32)
    got = _dequantized_keys(q, minimum, step, torch.float32)
    assert (got.view(np.float32) != fused).all(), "these inputs cannot tell one rounding from two"
    ties = np.float32(1.0) + np.float32(2.0**-8) * np.array([1, 3], np.float32)  # 0x3F808000, 0x3F818000
    got = _dequantized_keys(np.ones((1, 2, 1, 16), np.uint8), np.zeros((1, 1, 16), np.float32),
                            np.repeat(ties, 8).reshape(1, 1, 16), torch.bfloat16)
    assert set(got.reshape(-1).tolist()) == {0x3F80, 0x3F82}  # to even; half-up would give 0x3F81 for the first


def _dequantized_keys(keys: np.ndarray, k_min: np.ndarray, k_step: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Hand-made keys (values zero) dequantised into pages by the kernel: their bits, checked against the reference
    (``codecs.quantized.dequantize``, then the CPU decoder's rounding to ``dtype``)."""
    from vllm_kvcodec.codecs.quantized import _to_bits, dequantize
    from vllm_kvcodec.gpu.dequant_triton import QuantizedKV

    _, tokens, heads, dim = keys.shape
    t = torch.from_numpy
    q = QuantizedKV(t(keys), t(np.zeros_like(keys)), t(k_min), t(k_step), t(np.zeros((1, tokens, heads), np.float32)),
                    t(np.ones((1, tokens, heads), np.float32)), torch.zeros(0, dtype=_bits(torch.zeros(1, dtype=dtype)).dtype),
                    1, tokens, 0, 0, dtype)
    cache = torch.zeros(1, heads, tokens, 2 * dim, dtype=dtype)
    dequantize_into_pages(PackedPages([cache], dim), 0, q, 0, torch.arange(tokens))
    got = _bits(cache[0, :, :, :dim].transpose(0, 1)).numpy().view(DType.from_torch(dtype).bits_dtype)
    want = _to_bits(dequantize(keys[0], k_min, k_step), DType.from_torch(dtype))
    assert np.array_equal(got, want)
    return got


@pytest.mark.parametrize("order", lc.ORDERS)
def test_gpu_fetcher_dequantizes_lossy_objects_on_the_device(real_kv_1k, order) -> None:
    """int8, int4 with sink tokens and a full layer, beside lossless splitzip and rans: the GPU load path writes
    what the CPU fetcher writes (the reference dequantisation), and the lossy objects are decoded by the kernel."""
    lossy = Precision("int4", sink_tokens=3, full_layers=1)
    sc = _scenario(real_kv_1k, ["int8", "splitzip", lossy, "rans"], first_token=5, seed=30)
    gpu, cpu = sc.caches("cpu", order), sc.caches("cpu", order)
    stats = ConnectorStats()
    job = _run(CudaFetcher, sc, gpu, stats)
    _run(Fetcher, sc, cpu)
    assert not job.failed_blocks
    assert lc.caches_equal(gpu, cpu) and lc.caches_equal(gpu, sc.expected())
    assert not lc.caches_equal(gpu, _scenario(real_kv_1k, ["raw"], first_token=5, seed=30).expected()), "lossy"
    totals = stats.totals()
    assert totals["codec_quantized_loads"] == 4 and totals["gpu_decoded_objects"] == 6  # + 2 splitzip


def _forged_scales(payload: bytearray, head) -> bytes:
    """The payload with one key step NaN, re-coded as a writer would (the checksum stays valid)."""
    from vllm_kvcodec.codecs.quantized import _SCALES, _half
    from vllm_kvcodec.codecs.rans import encode_plane
    from vllm_kvcodec.format import codec_for

    parts = codec_for(head).unpack(memoryview(payload), head.dtype, head.shape)
    k_step = parts.k_step.copy()
    k_step[0, 1, 2] = np.nan
    scales = _SCALES.encode(np.concatenate([_half(a) for a in (parts.k_min, k_step, parts.v_min, parts.v_step)]),
                            DType.BFLOAT16)
    return b"".join((np.uint32(len(scales)).tobytes(), scales, parts.kept.tobytes(),
                     encode_plane(parts.keys.reshape(-1)), encode_plane(parts.values.reshape(-1))))


def test_gpu_fetcher_fails_bad_lossy_objects_and_writes_nothing(real_kv_1k) -> None:
    """A NaN step, a truncated integer plane, 8-bit integers under a 4-bit config: each resealed (a valid checksum
    and key), each a failed load of exactly its blocks, none of its bytes written: as the CPU fetcher decides."""
    sc = _scenario(real_kv_1k, ["int8"], seed=31)
    chunks = [c for spec in sc.specs for c in spec.chunks]
    _rewrap(sc, chunks[0], 0, _forged_scales)
    _rewrap(sc, chunks[1], 1, lambda payload, head: payload[:-3])
    key = sc.addresses.key(chunks[2].chunk_hash, 0)
    head = read_header(sc.store.get(key), key=key)
    sc.store.put(key, build_chunk(memoryview(sc.store.get(key))[head.payload_offset : head.payload_offset + head.payload_length],
                                  head.dtype, head.shape, {**head.codec_config, "bits": 4}, key=key))
    gpu, stats = sc.caches("cpu"), ConnectorStats()
    _failed_exactly(sc, _run(CudaFetcher, sc, gpu, stats), gpu, [(chunks[0], 0), (chunks[1], 1), (chunks[2], 0)])
    assert stats.totals()["gpu_decoded_objects"] == 2 * len(chunks) - 3  # the others: dequantised on the device


# ---- the 8-bit video variant: integers as HEVC 4:4:4 8-bit pictures, NVDEC (the 2.0.4 stand-in, libav behind it) ----


def _integer_stream(blob: bytes):
    """x265 lossless HEVC 4:4:4 of an object's integers, one packet per picture (the layout's pictures)."""
    pytest.importorskip("av")
    from vllm_kvcodec.codecs import video_av

    staged, head = _staged(blob, with_integers=False)
    geo = integer_geometry(head.shape, staged.codec)
    planes = integer_planes(staged.parts, geo)
    return staged, head, [memoryview(p) for p in video_av.encode_pictures(planes, "hevc", None, 1)]


def test_nvdec_integer_planes_dequantize_into_the_pages_bit_exactly(real_chunks) -> None:
    """An int8 object's integers as pictures, decoded by the product's NVDEC session (over the stand-in), cropped,
    checked (digest and range) and dequantised into the pages: the reference CPU decode, byte for byte."""
    from vllm_kvcodec.format import ValueDigest, value_digest

    kv = real_chunks[1][:2, :, :64].contiguous()
    blob = encode_chunk(kv, precision=Precision("int8", sink_tokens=2))
    staged, head, packets = _integer_stream(blob)
    shape = integer_shape(head.shape, staged.codec)
    ints = decode_integer_planes(packets, shape, _stand_in()(torch.device("cpu")), torch.device("cpu"))
    want = np.stack([staged.parts.keys, staged.parts.values])
    assert ints.dtype == torch.uint8 and np.array_equal(ints.numpy(), want)
    check = IntegerCheck(ValueDigest(1024, value_digest(want.tobytes(), 1024)), want.size, staged.codec.levels)
    back = torch.zeros(check.readback_bytes, dtype=torch.uint8)
    check.launch(ints, back)
    check.verify(back.numpy().tobytes())
    caches = _layer_caches(2, 10, 3, 8, 64, torch.bfloat16, "NHD", seed=9)
    slots = _odd_slots(10, 8, 60, seed=10)
    want_pages = _reference_pages(blob, caches, slots, 4)
    dequantize_into_pages(PackedPages(caches, 64), 0, _on_cpu(staged, ints), 4, slots)
    assert lc.caches_equal(caches, want_pages)


def test_integer_check_catches_a_decoder_that_lies_and_integers_out_of_range(real_chunks) -> None:
    """A decoder that changes one byte of a picture fails the integers' digest; integers above a 4-bit level fail
    the range check even under a digest that matches them."""
    from vllm_kvcodec.format import ValueDigest, value_digest

    blob = encode_chunk(real_chunks[0][:2, :, :32].contiguous(), precision="int8")
    staged, head, packets = _integer_stream(blob)
    shape = integer_shape(head.shape, staged.codec)
    want = np.stack([staged.parts.keys, staged.parts.values])
    lying = NvdecSessions(StandInNvc(pictures=_ConcealingPictures))(torch.device("cpu"))
    ints = decode_integer_planes(packets, shape, lying, torch.device("cpu"))
    check = IntegerCheck(ValueDigest(1024, value_digest(want.tobytes(), 1024)), want.size, 255)
    back = torch.zeros(check.readback_bytes, dtype=torch.uint8)
    check.launch(ints, back)
    with pytest.raises(CodecError, match="value digest"):
        check.verify(back.numpy().tobytes())
    honest = torch.from_numpy(want)
    range_check = IntegerCheck(ValueDigest(1024, value_digest(want.tobytes(), 1024)), want.size, 15)
    range_check.launch(honest, back)
    with pytest.raises(CodecError, match="exceed 15"):
        range_check.verify(back.numpy().tobytes())
