"""Stores for compressed KV chunks, behind one protocol, opened from a URL.

>>> from storage import open_store
>>> with open_store("memory://") as store:
...     store.put("model/ns/chunk-0", b"...")
...     store.get("model/ns/chunk-0")
b'...'

See docs/stores.md for the URL forms, options and guarantees.
"""

from storage.base import MAX_KEY_LENGTH, Store, validate_key
from storage.errors import InvalidKeyError, StoreError, StoreUnavailableError, StoreURLError
from storage.faults import FaultInjector
from storage.link import LinkEmulator
from storage.url import open_store

__all__ = [
    "MAX_KEY_LENGTH",
    "FaultInjector",
    "InvalidKeyError",
    "LinkEmulator",
    "Store",
    "StoreError",
    "StoreURLError",
    "StoreUnavailableError",
    "open_store",
    "validate_key",
]
