"""One small exception family for every store.

Callers on the hot path (lookup, fetch, save) need exactly one decision: "the
store could not answer, treat it as a miss / skip the save". That is
:class:`StoreUnavailableError`. Programming and configuration mistakes (a bad
key, a bad URL) are :class:`ValueError` as well, so they are never mistaken for
a flaky network and silently turned into recomputation.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of everything the storage package raises on purpose."""


class StoreUnavailableError(StoreError):
    """The store is unreachable, timed out, closed or failed an I/O operation.

    Transient by nature: the same call may succeed later. It is raised within the
    store's bounded timeouts, never after an unbounded wait.
    """


class InvalidKeyError(StoreError, ValueError):
    """A key breaks the key rules (see :func:`storage.base.validate_key`)."""


class StoreURLError(StoreError, ValueError):
    """A store URL has an unknown scheme, an unknown option or a bad value."""
