"""One exception family, so callers can catch every decoding failure in one place.

Everything that reads untrusted bytes (a stored chunk, a codec payload) raises a
subclass of :class:`ChunkFormatError`; the connector turns it into "recompute
these blocks", never into wrong KV.
"""


class KVCodecError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(KVCodecError, ValueError):
    """A codec, store or connector was configured with values it cannot use."""


class ChunkFormatError(KVCodecError, ValueError):
    """A blob is not a valid chunk: malformed, truncated, corrupted or unknown version."""


class CodecError(ChunkFormatError):
    """A codec payload does not decode to the size and layout its header promised."""


class UnsupportedDTypeError(ConfigError):
    """A codec was asked to encode a dtype it cannot represent bit-exactly."""


class StoreRequiredError(KVCodecError):
    """The store cannot be reached at start-up and the configuration requires it."""
