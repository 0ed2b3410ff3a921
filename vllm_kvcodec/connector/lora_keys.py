"""Which weights a LoRA request's chunks are keyed by: those the workers loaded for its adapter id.

vLLM reads an adapter's files in each worker, when a batch first uses its id
(or ``add_lora`` preloads it), again after its LRU cache evicted it, and at
every step for a request that asks for ``load_inplace``; in between it serves
the weights it read, whatever has become of the files. Keyed by the files as
they are when a request arrives, an adapter rewritten in place would store KV
of the old weights under the new weights' keys, for every instance that loads
the new files to find. So the workers fingerprint the files around each load
(:mod:`~.lora_loads`) and report it, and requests are keyed by what they last
reported for the adapter's id. An id no worker has reported yet (the first
requests, keyed before any batch used it) is keyed by its files as first seen
here, once per name, path and id; the workers check every load and save
against what they run, so a mismatch is neither loaded nor saved. An adapter
whose files cannot be read (a folder deleted or half replaced, a hub name,
which vLLM downloads elsewhere) and that no worker reported is not cached at
all: counted, logged once. Reading never raises: this runs in vLLM's engine
loop, where an exception takes EngineCore down.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvcodec.keys.identity import adapter_files
from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")


class AdapterKeys:
    def __init__(self, stats: ConnectorStats) -> None:
        self.stats = stats
        self._loaded: dict[int, str] = {}  # adapter id -> fingerprint of the files the workers loaded ("": unknown)
        self._first_seen: dict[tuple[str, str, int], str | None] = {}  # (name, path, id) -> its files, before any report
        self._warned: set[tuple[str, str]] = set()

    def weights(self, lora: Any) -> str | None:
        """The fingerprint ``lora``'s requests are keyed by; None when unknown (counted): they are not cached."""
        weights = self._loaded.get(lora.lora_int_id)
        if weights is None:
            seen = (lora.lora_name, str(lora.lora_path), lora.lora_int_id)
            if seen not in self._first_seen:
                self._first_seen[seen] = adapter_files(lora.lora_path)
            weights = self._first_seen[seen]
        if weights:
            return weights
        self.stats.add(adapter_unreadable_requests=1)
        if (lora.lora_name, str(lora.lora_path)) not in self._warned:
            self._warned.add((lora.lora_name, str(lora.lora_path)))
            logger.warning("kvcodec: LoRA adapter %r at %s: which files its weights come from is unknown (no "
                           "readable local folder there, or rewritten while a worker loaded it); its requests are "
                           "neither loaded nor saved until a worker loads it from readable files",
                           lora.lora_name, lora.lora_path)
        return None

    def adopt(self, loads: dict[int, str]) -> None:
        """The workers' report of the adapters they loaded: later requests of those ids are keyed by it."""
        self._loaded.update(loads)
