"""How each half of the connector opens its store: guarded against outages, strict only if asked.

The cache is an accelerator, not a dependency: by default an engine whose store
is unreachable at start-up starts anyway, serves every request by recompute,
and starts hitting once the store answers (see :mod:`storage.outage`). A
deployment that would rather not run without its cache (a benchmark, a fleet
where a missing store means a misconfiguration) sets
``require_store_at_startup`` and gets a clear start-up error instead.
"""

from __future__ import annotations

import logging

from storage import StoreError, open_store
from storage.outage import OutageGuard
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import StoreRequiredError

logger = logging.getLogger("vllm_kvcodec")


def open_connector_store(config: ConnectorConfig) -> OutageGuard:
    """The store of ``config.store``, checked with one round trip at start-up."""
    store = OutageGuard(config.store, open_store, retry_s=config.store_retry_s)
    try:
        store.probe()
    except StoreError as exc:
        if config.require_store_at_startup:
            store.close()
            raise StoreRequiredError(
                f"store {store.url} cannot be reached at start-up and require_store_at_startup is set: {exc}"
            ) from None
        logger.warning("kvcodec: store %s is not reachable at start-up; serving by recompute until it answers: %s",
                       store.url, exc)
    return store
