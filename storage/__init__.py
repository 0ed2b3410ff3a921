"""Stores for compressed KV chunks, behind one protocol, opened from a URL.

>>> from storage import open_store
>>> with open_store("memory://") as store:
...     store.put("model/ns/chunk-0", b"...")
...     store.get("model/ns/chunk-0")
b'...'

See docs/stores.md for the URL forms, options and guarantees; the test and benchmark
wrappers (``link+``, ``faults+``) and servers live in :mod:`storage.testing`.
"""

from storage.base import MAX_KEY_LENGTH, Store, validate_key
from storage.errors import InvalidKeyError, StoreError, StoreUnavailableError, StoreURLError
from storage.ranged import RangedValue
from storage.registry import check_url, describe_schemes, open_store, reads_in_memory

__all__ = [
    "MAX_KEY_LENGTH",
    "InvalidKeyError",
    "RangedValue",
    "Store",
    "StoreError",
    "StoreURLError",
    "StoreUnavailableError",
    "check_url",
    "describe_schemes",
    "open_store",
    "reads_in_memory",
    "validate_key",
]
