"""Small checks every decoder runs on untrusted sizes before it allocates or copies."""

from __future__ import annotations

from vllm_kvcodec.errors import CodecError


def expect_size(what: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise CodecError(f"{what}: expected {expected} bytes, got {actual}")


def expect_at_most(what: str, actual: int, limit: int) -> None:
    if actual < 0 or actual > limit:
        raise CodecError(f"{what}: {actual} is outside [0, {limit}]")


class Reader:
    """Bounds-checked cursor over a payload: every take() is validated first."""

    def __init__(self, payload: memoryview, what: str) -> None:
        self._buf = memoryview(payload).cast("B")
        self._pos = 0
        self._what = what

    @property
    def remaining(self) -> int:
        return len(self._buf) - self._pos

    def take(self, n: int, field: str) -> memoryview:
        if n < 0 or n > self.remaining:
            raise CodecError(
                f"{self._what}: truncated at {field} (needs {n} bytes, {self.remaining} left)"
            )
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def u32(self, field: str) -> int:
        return int.from_bytes(self.take(4, field), "little")

    def finish(self) -> None:
        if self.remaining:
            raise CodecError(f"{self._what}: {self.remaining} unexpected trailing bytes")
