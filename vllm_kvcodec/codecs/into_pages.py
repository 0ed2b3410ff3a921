"""Decoded values written straight into paged memory: one kernel call per object, no intermediate array.

A page object that lands whole in host caches goes to a list of page extents
(about 30-60 per object: each layer's run of blocks). Decoding it into a new
array and then copying that array into the extents moves every byte twice;
the kernels here write each value where it goes as they decode it. Measured
on 2 cores (AMX Xeon), splitzip into 94 MB of destination: 29.7 ms decoded
then copied, 18.5 ms straight into it, on one thread (14.9 against 10.3 ms on
two). It must be one kernel call per object that walks every extent: a call
per extent (about 1000 per 4096-token load) spent the gain on dispatch.

The kernels write through raw addresses, so what they are given must be
right, and it is checked before the first write: :class:`PageExtents` is made
only from buffers of the engine's own caches (never from stored bytes), its
lengths must sum to exactly the object's size and each be a whole number of
the kernel's unit; the codec has validated every stream's size against the
header's shape, and escape positions are checked in full before any value is
written.
"""

from __future__ import annotations

from collections.abc import Sequence

import vllm_kvcodec.codecs.numba_compat  # noqa: F401  (before numba; see its docstring)
import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from vllm_kvcodec.codecs.dtypes import DType


class PageExtents:
    """Where an object's bytes go, in payload order: the addresses and lengths of writable host buffers.

    Holds the buffers, so the memory stays valid while the extents are used.
    """

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self._buffers = list(buffers)
        arrays = [np.frombuffer(b, dtype=np.uint8) for b in self._buffers]
        if any(not a.flags.writeable for a in arrays):
            raise ValueError("page extents must be writable")
        self.addresses = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
        self.nbytes = np.array([a.nbytes for a in arrays], dtype=np.int64)

    @classmethod
    def within(cls, owners: Sequence[memoryview], addresses: Sequence[int], nbytes: Sequence[int]) -> PageExtents:
        """Extents already known as addresses inside ``owners`` (writable buffers, kept alive with the extents).

        For a caller that computed them itself from a buffer's base address
        (the fetcher: a layer cache plus each run's offset), so that no view
        or array is made per extent.
        """
        if any(o.readonly for o in owners):
            raise ValueError("page extents must be writable")
        extents = cls.__new__(cls)
        extents._buffers = list(owners)
        extents.addresses = np.asarray(addresses, dtype=np.int64)
        extents.nbytes = np.asarray(nbytes, dtype=np.int64)
        return extents

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())

    def holds(self, nbytes: int, unit: int) -> bool:
        """Exactly ``nbytes`` in all, each extent a whole number of ``unit`` bytes (what a kernel writes at once)."""
        return self.total == nbytes and not np.any(self.nbytes % unit)


def merge_into(exps: np.ndarray, rest: np.ndarray, dtype: DType, extents: PageExtents) -> bool:
    """2-byte values from their exponent-like and other byte plane (``planes.split_planes``), into ``extents``.

    False (nothing written) for a dtype these planes do not describe or
    extents that do not hold exactly these values.
    """
    n = exps.shape[0]
    if dtype not in (DType.BFLOAT16, DType.FLOAT16) or rest.shape[0] != n or not extents.holds(2 * n, 2):
        return False
    _merge16_into(np.ascontiguousarray(exps), np.ascontiguousarray(rest), dtype is DType.BFLOAT16,
                  extents.addresses, extents.nbytes)
    return True


@intrinsic
def pointer_to(typingctx, address, like):  # noqa: ARG001 - numba's intrinsic signature
    """``address`` (an int64) as a pointer to ``like``'s element type, for ``numba.carray``."""
    ptr_type = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.inttoptr(args[0], context.get_value_type(ptr_type))

    return ptr_type(address, like), codegen


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _merge16_into(exps: np.ndarray, rest: np.ndarray, bf16: bool, addresses: np.ndarray, nbytes: np.ndarray) -> None:
    i = 0
    like = np.empty(0, dtype=np.uint16)
    for e in range(addresses.shape[0]):
        out = numba.carray(pointer_to(addresses[e], like), nbytes[e] // 2)
        w = out.shape[0]
        if bf16:
            _merge_bf16(exps[i : i + w], rest[i : i + w], out)
        else:
            _merge_f16(exps[i : i + w], rest[i : i + w], out)
        i += w


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _merge_bf16(exps: np.ndarray, signman: np.ndarray, out: np.ndarray) -> None:
    for j in range(out.shape[0]):
        sm = np.uint16(signman[j])
        sign = (sm & np.uint16(0x80)) << np.uint16(8)
        out[j] = sign | (np.uint16(exps[j]) << np.uint16(7)) | (sm & np.uint16(0x7F))


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _merge_f16(high: np.ndarray, low: np.ndarray, out: np.ndarray) -> None:
    for j in range(out.shape[0]):
        out[j] = (np.uint16(high[j]) << np.uint16(8)) | np.uint16(low[j])
