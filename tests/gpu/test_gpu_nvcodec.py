"""NVDEC path of the video codec (vllm_kvcodec/gpu/nvcodec.py), as far as a CPU can check it.

No NVIDIA driver here: PyNvVideoCodec must be reported unavailable with a
reason, never raise at import. The code after the decoder (payload parsing,
cropping, joining, the exponent checksum) runs on CPU tensors with libav
decoding the same HEVC stream in NVDEC's place.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from vllm_kvcodec.errors import CodecError, ConfigError
from vllm_kvcodec.gpu import nvcodec


@pytest.fixture
def no_pynvvideocodec(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)  # makes the import raise ImportError
    nvcodec._reset_import_cache()
    yield
    nvcodec._reset_import_cache()


def test_unavailable_is_a_reason_not_an_exception(no_pynvvideocodec) -> None:
    ok, reason = nvcodec.nvdec_available()
    assert ok is False and "PyNvVideoCodec is not importable" in reason
    ok, reason_enc = nvcodec.nvenc_available()
    assert ok is False and reason_enc == reason
    with pytest.raises(nvcodec.NvCodecUnavailable, match="PyNvVideoCodec is not importable"):
        nvcodec.nvdec_decode_planes(b"\0\0\0\1", 144, 144, 1)
    with pytest.raises(nvcodec.NvCodecUnavailable):
        nvcodec.nvenc_encode_planes(np.zeros((1, 3, 144, 144), dtype=np.uint8))
    assert issubclass(nvcodec.NvCodecUnavailable, ConfigError)


def test_available_here_matches_reality() -> None:
    nvcodec._reset_import_cache()
    ok, reason = nvcodec.nvdec_available()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if not torch.cuda.is_available():
        assert ok is False


def test_payload_header_matches_the_video_codec() -> None:
    video = pytest.importorskip("vllm_kvcodec.codecs.video")
    assert nvcodec.VIDEO_HEAD.format == video._HEAD.format


@pytest.fixture(scope="module")
def video_chunk(real_kv_1k: torch.Tensor):
    pytest.importorskip("av")
    from vllm_kvcodec.format import encode_chunk

    kv = real_kv_1k[:, :, :52].contiguous()  # 3120 rows of 192 exponents: 2 pictures of 192 x 520
    return kv, encode_chunk(kv, "video")


def _libav_planes(stream: bytes, width: int, height: int, frames: int, device: torch.device) -> torch.Tensor:
    """Stand-in for NVDEC: libav decodes the same elementary stream (split at its packet sizes)."""
    from vllm_kvcodec.codecs import video_av

    sizes = _libav_planes.sizes
    packets, at = [], 0
    for s in sizes:
        packets.append(memoryview(stream)[at : at + s])
        at += s
    planes = video_av.decode_pictures(packets, "hevc", width, height)
    return torch.from_numpy(planes).to(device)


def _payload(blob: bytes) -> tuple[memoryview, tuple[int, ...]]:
    from vllm_kvcodec.format import read_header

    h = read_header(blob)
    return memoryview(blob)[h.payload_offset : h.payload_offset + h.payload_length], h.shape


def test_stream_is_annex_b_hevc(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    parsed = nvcodec.parse_video_payload(payload, shape)
    assert (parsed.width, parsed.height, parsed.frames) == (192, 520, 2)
    stream = bytes(parsed.stream)
    assert stream.startswith(nvcodec.ANNEXB_START)
    assert (stream[4] >> 1) & 0x3F == 32  # the first NAL unit is a VPS
    assert sum(parsed.packet_sizes) == len(stream) and len(parsed.packet_sizes) == parsed.frames


def test_gpu_side_of_the_decode_is_bit_exact(video_chunk) -> None:
    kv, blob = video_chunk
    payload, shape = _payload(blob)
    _libav_planes.sizes = nvcodec.parse_video_payload(payload, shape).packet_sizes
    got = nvcodec.decode_video_chunk_nvdec(blob, "cpu", planes_decoder=_libav_planes)
    assert got.dtype == torch.bfloat16 and got.shape == kv.shape
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))


def test_exponent_checksum_catches_a_wrong_picture(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    _libav_planes.sizes = nvcodec.parse_video_payload(payload, shape).packet_sizes

    def corrupt(*args):
        planes = _libav_planes(*args).clone()
        planes[0, 0, 0, 0] ^= 1
        return planes

    with pytest.raises(CodecError, match="checksum"):
        nvcodec.decode_video_chunk_nvdec(blob, "cpu", planes_decoder=corrupt)


def test_payload_validation(video_chunk) -> None:
    _, blob = video_chunk
    payload, shape = _payload(blob)
    with pytest.raises(CodecError):
        nvcodec.parse_video_payload(payload[:-1], shape)
    with pytest.raises(CodecError):
        nvcodec.parse_video_payload(payload, (shape[0] + 1, *shape[1:]))
    with pytest.raises(CodecError):
        nvcodec.parse_video_payload(payload[:10], shape)


def test_only_hevc_video_chunks(real_kv_1k: torch.Tensor) -> None:
    from vllm_kvcodec.format import encode_chunk

    blob = encode_chunk(real_kv_1k[:1, :, :4].contiguous(), "splitzip")
    with pytest.raises(ConfigError, match="hevc"):
        nvcodec.decode_video_chunk_nvdec(blob, "cpu")


def test_needs_the_library_for_the_real_decoder(video_chunk, no_pynvvideocodec) -> None:
    _, blob = video_chunk
    with pytest.raises(nvcodec.NvCodecUnavailable):
        nvcodec.decode_video_chunk_nvdec(blob, "cuda")


class _FakeFrame:
    """What a PyNvVideoCodec frame offers: DLPack (and a pixel format)."""

    def __init__(self, t: torch.Tensor, fmt: str = "Pixel_Format.YUV444") -> None:
        self.t, self.format = t, fmt

    def __dlpack__(self, *args, **kwargs):
        return self.t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@pytest.mark.parametrize("layout", ["stacked_2d", "planar_3d", "pitched"])
def test_frame_planes_layouts(layout: str) -> None:
    h, w = 144, 152
    planes = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
    if layout == "stacked_2d":
        t = planes.reshape(3 * h, w)
    elif layout == "planar_3d":
        t = planes
    else:  # rows padded to a 256-byte pitch
        t = torch.zeros(3 * h, 256, dtype=torch.uint8)
        t[:, :w] = planes.reshape(3 * h, w)
    got = nvcodec._frame_planes(_FakeFrame(t), w, h, torch.device("cpu"))
    assert torch.equal(got, planes)


def test_frame_planes_refuses_420() -> None:
    t = torch.zeros(216, 144, dtype=torch.uint8)
    with pytest.raises(nvcodec.NvCodecUnavailable, match="4:4:4"):
        nvcodec._frame_planes(_FakeFrame(t, "Pixel_Format.NV12"), 144, 144, torch.device("cpu"))
