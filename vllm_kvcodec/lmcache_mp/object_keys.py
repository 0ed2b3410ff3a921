"""One printable-ASCII name per LMCache ``ObjectKey``: the store key our L2 adapter writes under and the key a serde binds its chunks to.

LMCache's MP keys carry a model name and a per-user ``cache_salt`` that may hold
characters a store key may not (and could be long), so both are folded into an
XXH3-128 digest; rank, object group and the chunk hash stay readable. The name
is stable across processes, machines and Python versions (no ``hash()``, no pickle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

#: Bumped if the name layout ever changes, so a new reader never binds to an old writer's names.
KEY_LAYOUT = "lmcmp1"


def object_name(key: ObjectKey) -> str:
    """``lmcmp1/<model+salt digest>/<kv_rank>/<object_group_id>/<chunk hash hex>``."""
    scope = xxhash.xxh3_128_hexdigest(b"\0".join((key.model_name.encode(), key.cache_salt.encode())))
    return f"{KEY_LAYOUT}/{scope}/{key.kv_rank}/{key.object_group_id}/{bytes(key.chunk_hash).hex()}"


def group_binding(key: ObjectKey, group: int) -> str:
    """What KV group ``group`` of ``key``'s object is bound to: a chunk moved to another key or group is refused."""
    return f"{object_name(key)}#{group}"
