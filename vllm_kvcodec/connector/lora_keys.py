"""Which weights a LoRA request's chunks are keyed by, found without ever raising inside vLLM's scheduler.

A request's adapter is keyed by its files as first seen here, once per name,
path and id (not per request: statting and reading them for every new
request cost the scheduler loop, and an adapter deleted or replaced between a
listing and a read raised there, which takes vLLM's EngineCore down). An
adapter whose files cannot be read (a folder deleted or half replaced, a hub
name, which vLLM downloads elsewhere) has no weights to key by: its requests
are neither loaded nor saved, counted, logged once.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvcodec.identity import adapter_files
from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")


class AdapterKeys:
    def __init__(self, stats: ConnectorStats) -> None:
        self.stats = stats
        self._first_seen: dict[tuple[str, str, int], str | None] = {}  # (name, path, id) -> its files' fingerprint
        self._warned: set[tuple[str, str]] = set()

    def weights(self, lora: Any) -> str | None:
        """The fingerprint ``lora``'s requests are keyed by; None when unknown (counted): they are not cached."""
        seen = (lora.lora_name, str(lora.lora_path), lora.lora_int_id)
        if seen not in self._first_seen:
            self._first_seen[seen] = adapter_files(lora.lora_path)
        weights = self._first_seen[seen]
        if weights:
            return weights
        self.stats.add(adapter_unreadable_requests=1)
        if (lora.lora_name, str(lora.lora_path)) not in self._warned:
            self._warned.add((lora.lora_name, str(lora.lora_path)))
            logger.warning("kvcodec: LoRA adapter %r at %s: no readable local folder of weight files there; its "
                           "requests are neither loaded nor saved", lora.lora_name, lora.lora_path)
        return None
