"""One exception family, so callers can catch every decoding failure in one place.

Everything that reads untrusted bytes (a stored chunk, a codec payload) raises a
subclass of :class:`ChunkFormatError`; the connector turns it into "recompute
these blocks", never into wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence


class KVCodecError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(KVCodecError, ValueError):
    """A codec, store or connector was configured with values it cannot use.

    ``problems``, where several settings are wrong at once: one line each,
    ``<key>: <reason>``. The message is then the heading and one problem per
    line (a single problem follows the heading on its line), so each reads
    on its own in a terminal and in a log.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        self.heading, self.problems = message, tuple(problems)
        if len(self.problems) == 1:
            message = f"{message}: {self.problems[0]}"
        elif self.problems:
            message = "\n  ".join([f"{message} ({len(self.problems)} problems):", *self.problems])
        super().__init__(message)


class ChunkFormatError(KVCodecError, ValueError):
    """A blob is not a valid chunk: malformed, truncated, corrupted or unknown version."""


class CodecError(ChunkFormatError):
    """A codec payload does not decode to the size and layout its header promised."""


class UnsupportedDTypeError(ConfigError):
    """A codec was asked to encode a dtype it cannot represent bit-exactly."""


class StoreRequiredError(KVCodecError):
    """The store cannot be reached at start-up and the configuration requires it."""
