"""Stores for compressed KV chunks, behind one protocol, opened from a URL.

>>> from storage import open_store
>>> with open_store("memory://") as store:
...     store.put("model/ns/chunk-0", b"...")
...     store.get("model/ns/chunk-0")
b'...'

See docs/stores.md for the URL forms, options and guarantees; the test and benchmark
wrappers (``link+``, ``faults+``) and servers live in :mod:`storage.testing`.
"""

#: The distribution this top-level ``storage`` package belongs to. ``storage`` is a common name: vllm_kvcodec checks
#: this marker when it is imported, so a package of that name from another distribution (or a folder on sys.path)
#: that shadows this one is refused at once, by path, instead of failing later with a confusing AttributeError.
DISTRIBUTION = "vllm-kvcodec"

from storage.base import MAX_KEY_LENGTH, Store, validate_key  # noqa: E402
from storage.errors import InvalidKeyError, StoreError, StoreUnavailableError, StoreURLError  # noqa: E402
from storage.ranged import RangedValue  # noqa: E402
from storage.registry import check_url, describe_schemes, open_store, reads_in_memory  # noqa: E402

__all__ = [
    "DISTRIBUTION",
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
