"""The codec interface, in the spirit of numcodecs: one small class, a config dict, an id.

A codec turns the bit patterns of one chunk (an unsigned-integer numpy array in
the canonical shape) into bytes and back. It never sees headers or checksums:
the chunk format (:mod:`vllm_kvcodec.format`) owns those, and passes the codec
the dtype and shape it has already validated, so a decoder knows exactly how
many elements it may produce before it allocates anything.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vllm_kvcodec.codecs.dtypes import DType
from vllm_kvcodec.errors import ConfigError, UnsupportedDTypeError

if TYPE_CHECKING:
    from vllm_kvcodec.codecs.into_pages import PageExtents


class Codec(abc.ABC):
    """A lossless (unless ``lossless`` is False) transform of one chunk's bits."""

    codec_id: ClassVar[str]
    lossless: ClassVar[bool] = True
    dtypes: ClassVar[frozenset[DType]] = frozenset(DType)

    @abc.abstractmethod
    def encode(self, bits: np.ndarray, dtype: DType) -> bytes:
        """Encode a contiguous unsigned array holding the chunk's bit patterns."""

    @abc.abstractmethod
    def decode(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        """Decode ``payload`` into a new array of ``dtype.bits_dtype`` and ``shape``.

        ``payload`` is untrusted: raise :class:`~vllm_kvcodec.errors.CodecError`
        on anything that does not decode to exactly ``shape``.
        """

    def decode_borrowed(self, payload: memoryview, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        """:meth:`decode`, but the result may share (read-only) memory with ``payload``.

        The load path copies a decoded object into paged memory at once and
        drops it, so a codec whose decode would only copy the payload (``raw``)
        can hand it over as it is: a 94 MB prefix load saves a 94 MB copy.
        Callers read the result and never write it.
        """
        return self.decode(payload, dtype, shape)

    def decode_into(self, payload: memoryview, dtype: DType, shape: tuple[int, ...], extents: PageExtents) -> bool:
        """Decode ``payload`` straight into ``extents`` (an object's pages in host memory, in order), if this codec can.

        False, having written nothing, where it cannot (this dtype, these
        extents): the caller then decodes and copies. A payload that does not
        decode raises :class:`~vllm_kvcodec.errors.CodecError`; a codec
        validates every size before its first write (see :mod:`.into_pages`).
        """
        return False

    def get_config(self) -> dict[str, Any]:
        """The parameters that rebuild this codec (stored in every chunk header)."""
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Codec":
        params = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**params)
        except TypeError as exc:
            raise ConfigError(f"bad parameters for codec {cls.codec_id!r}: {exc}") from None

    def supports(self, dtype: DType) -> bool:
        return dtype in self.dtypes

    def check_dtype(self, dtype: DType) -> None:
        if not self.supports(dtype):
            names = ", ".join(sorted(d.name.lower() for d in self.dtypes))
            raise UnsupportedDTypeError(
                f"codec {self.codec_id!r} cannot encode {dtype.name.lower()} bit-exactly "
                f"(it supports {names}); use codec 'raw' or 'zstd' for this dtype"
            )

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.get_config().items())))
