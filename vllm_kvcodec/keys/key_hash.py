"""The hash function of every store key: SHA-256 by default, XXH3-128 only when asked for.

A shared store is a prefix cache every instance and tenant of a fleet reads,
and it outlives the engines that fill it. vLLM hashes its own (per-process)
prefix cache with SHA-256 by default since CVE-2025-25183 showed crafted
collisions poisoning a prefix cache; a key chain here is the same kind of
object with a wider audience, so it follows the same rule. XXH3-128 stays an
opt-in for deployments whose every prompt is trusted: it is several times
faster, but not collision resistant, so someone who chooses prompts could
make two prefixes share a key (and one tenant read KV computed for another
one's prompt, or poison it). vLLM keeps a *secret* per-process seed for its
non-cryptographic algorithms; a store shared across processes cannot, which
makes XXH3 weaker here than in vLLM's local cache.

``auto`` follows vLLM's own ``prefix_caching_hash_algo``, so one setting
governs both caches: ``sha256`` and ``sha256_cbor`` give SHA-256,
``xxhash`` and ``xxhash_cbor`` XXH3-128 (with vLLM's warning). The name is
part of the key namespace (:class:`~vllm_kvcodec.keys.chain.Namespace`): objects
saved under one algorithm are simply not found under the other.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import xxhash

from vllm_kvcodec.errors import ConfigError

logger = logging.getLogger("vllm_kvcodec")

SHA256 = "sha256"
XXH3 = "xxh3_128"
#: vLLM's ``prefix_caching_hash_algo`` values and the key hash each one means here.
FROM_VLLM = {"sha256": SHA256, "sha256_cbor": SHA256, "xxhash": XXH3, "xxhash_cbor": XXH3}
#: The ``hash_algo`` setting's values (``kv_connector_extra_config``) and what each one means.
SETTINGS = {"auto": None, "sha256": SHA256, "xxh3": XXH3}

_DIGEST: dict[str, Callable[[bytes], bytes]] = {
    SHA256: lambda data: hashlib.sha256(data).digest(),
    XXH3: xxhash.xxh3_128_digest,
}
#: Bytes of each algorithm's digest (a key's hex form is twice as long).
DIGEST_BYTES = {SHA256: 32, XXH3: 16}


def digest_function(algo: str) -> Callable[[bytes], bytes]:
    """The digest of ``algo`` (a name :func:`resolve` returned)."""
    try:
        return _DIGEST[algo]
    except KeyError:
        raise ConfigError(f"unknown key hash {algo!r}; known: {', '.join(_DIGEST)}") from None


def resolve(setting: str, vllm_algo: str | None) -> str:
    """The key hash for the connector's ``hash_algo`` setting, ``auto`` following vLLM's ``prefix_caching_hash_algo``.

    Warns, as vLLM does, when the result is not collision resistant.
    """
    if setting not in SETTINGS:
        raise ConfigError(f"hash_algo {setting!r} is not one of {', '.join(SETTINGS)}")
    algo = SETTINGS[setting]
    if algo is None:
        algo = FROM_VLLM.get(vllm_algo or "sha256")
        if algo is None:
            raise ConfigError(f"vLLM's prefix_caching_hash_algo {vllm_algo!r} has no key hash here; "
                              f"set hash_algo to one of {', '.join(a for a in SETTINGS if a != 'auto')}")
    if algo == XXH3:
        logger.warning(
            "kvcodec: store keys use XXH3-128, which is not collision resistant: anyone who chooses prompts could "
            "craft two prefixes with one key, and read or poison KV across tenants of the shared store. Use it only "
            "where every prompt is trusted; hash_algo sha256 (the default) rules this out.")
    return algo
