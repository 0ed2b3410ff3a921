"""Which codec stores a chunk: one policy that the connector, its config, the chunk format and the LMCache plug-in ask.

- **Lossless only.** Wherever a codec is named (connector config, plug-in
  config, ``encode_chunk``), a codec that is not bit-exact is refused; no lossy
  codec can become a default by accident.
- **The default** is the densest bit-exact codec, :data:`DEFAULT_CODEC`; for a
  dtype it cannot hold (float16 for the exponent codecs) it is
  :data:`FALLBACK_CODEC`, which holds any dtype. For the 1-byte float8 caches
  it is :data:`FLOAT8_DEFAULT` (zstd at level 3, the best cheap codec measured
  on real fp8 KV; ``raw`` and ``zstd`` are the only codecs that hold float8:
  the exponent codecs refuse it by name).
- **auto** (connector only) picks among :data:`AUTO_CANDIDATES` at run time,
  from measured link and decode speeds (:mod:`.choice`).
- **A named codec that cannot hold the dtype**: the connector, configured once
  per deployment for one model, refuses to start; the LMCache plug-in, which
  meets whatever dtypes LMCache hands it, falls back and logs it.
"""

from __future__ import annotations

from typing import Any, Literal

from vllm_kvcodec.codecs.base import Codec
from vllm_kvcodec.codecs.precision import Precision, parse_precision
from vllm_kvcodec.codecs.quantized import ENTROPY
from vllm_kvcodec.codecs.registry import get_codec
from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ConfigError

DEFAULT_CODEC = "rans"
FALLBACK_CODEC = "zstd"
AUTO = "auto"
AUTO_CANDIDATES = ("raw", "splitzip", "zstd", "rans")
#: The default for float8 caches: zstd-3 gave 1.208x (e4m3) / 1.403x (e5m2) on SmolLM2's fp8 KV, zstd-1 1.188x / 1.381x.
FLOAT8_DEFAULT: dict[str, Any] = {"id": "zstd", "level": 3}
#: What codes a lossy level's integers unless told otherwise. Measured against HEVC in KVCodec's token-per-frame
#: layout, HEVC in a naive layout and FFV1 (``kvcodec bench layouts``, docs/codec-video.md): the smallest at int8
#: (7.72 bits per value against HEVC's 9.75), within 1 % of FFV1 at int4, and 9x or more faster to decode.
DEFAULT_LOSSY_ENTROPY = "rans"

CodecSpec = str | dict[str, Any]


class LossyCodecError(ConfigError):
    """A lossy codec was named where only bit-exact KV may be stored."""


def lossless_codec(spec: CodecSpec | Codec) -> Codec:
    """The codec ``spec`` names; raises ConfigError for an unknown one, LossyCodecError for a lossy one."""
    codec = get_codec(spec)
    if not codec.lossless:
        raise LossyCodecError(f"codec {codec.codec_id!r} is lossy; vllm-kvcodec only stores bit-exact KV")
    return codec


def precision_codec(precision: "str | Precision | None", entropy: CodecSpec | None = None) -> Codec | None:
    """The codec a lossy ``precision`` level stores with (LOSSY: NOT BIT-EXACT), ``entropy`` coding its integers
    (None: :data:`DEFAULT_LOSSY_ENTROPY`); None for ``lossless``, where the lossless rules above apply. The one
    door a lossy codec comes through: a precision level names it, never a codec setting."""
    level = parse_precision(precision)
    if level.lossless:
        return None
    if entropy is not None and not isinstance(entropy, str):
        raise ConfigError(f"a lossy precision codes its integers with one of {', '.join(ENTROPY)}, not {entropy!r}")
    return get_codec({"id": "quantized", "bits": level.bits, "sink_tokens": level.sink_tokens,
                      "full_layers": level.full_layers, "entropy": entropy or DEFAULT_LOSSY_ENTROPY})


def check_spec(spec: CodecSpec | None, allow_auto: bool) -> CodecSpec | None:
    """Validate a configured codec without a dtype yet (config time): known, lossless, ``auto`` where allowed."""
    if spec is None or (spec == AUTO and allow_auto):
        return spec
    if spec == AUTO:
        raise ConfigError("codec 'auto' chooses by the connector's measured link; name a codec here (e.g. rans)")
    lossless_codec(spec)
    return spec


def default_codec_for(dtype: DType) -> CodecSpec:
    """The best lossless codec that can represent ``dtype`` (an id, or a config dict for float8)."""
    if dtype.is_float8:
        return dict(FLOAT8_DEFAULT)
    return DEFAULT_CODEC if get_codec(DEFAULT_CODEC).supports(dtype) else FALLBACK_CODEC


#: Encode cost order, from one-core MB/s on real bf16 KV (docs/benchmarks.md): raw 8307, splitzip 1073,
#: zstd-1 467, zstd-3 230, rans 236, video 13-38. A save that falls behind only ever moves down it.
_ENCODE_RANK = {"raw": 0, "splitzip": 1, "zstd": 2, "rans": 3, "video": 4}


def encode_rank(codec: Codec) -> int:
    """Where ``codec`` stands in encode cost (zstd above level 1 with rans: about as slow)."""
    config = codec.get_config()
    if config["id"] == "zstd" and config.get("level", 1) > 1:
        return _ENCODE_RANK["rans"]
    return _ENCODE_RANK.get(config["id"], max(_ENCODE_RANK.values()))


def behind_codec_for(spec: CodecSpec | None, dtype: DType) -> Codec | None:
    """The codec for chunks saved while the saver is behind (``save_codec_when_behind``), if it holds ``dtype``.

    None where none is asked for, or the one named cannot hold ``dtype``
    (splitzip and float8): those chunks keep the usual codec.
    """
    if spec is None:
        return None
    codec = lossless_codec(spec)
    return codec if codec.supports(dtype) else None


def auto_candidates(dtype: DType) -> tuple[CodecSpec, ...]:
    """What codec ``auto`` may pick among for ``dtype``: the candidates that hold it (float8: raw, zstd-3)."""
    if dtype.is_float8:
        return ("raw", dict(FLOAT8_DEFAULT))
    return tuple(c for c in AUTO_CANDIDATES if get_codec(c).supports(dtype))


def codec_for(spec: CodecSpec | None, dtype: DType, unsupported: Literal["error", "fallback"]) -> tuple[Codec, bool]:
    """The codec to store ``dtype`` chunks with, and whether it fell back from the one named.

    ``spec=None`` is the default for the dtype. A named codec that cannot hold
    ``dtype`` raises (``unsupported="error"``) or falls back to
    :data:`FALLBACK_CODEC` (``"fallback"``).
    """
    if spec is None:
        return get_codec(default_codec_for(dtype)), False
    codec = lossless_codec(spec)
    if codec.supports(dtype):
        return codec, False
    if unsupported == "error":
        codec.check_dtype(dtype)  # raises UnsupportedDTypeError naming the dtypes it holds
    return get_codec(FALLBACK_CODEC), True
