"""The connector's counters as vLLM's ``KVConnectorStats``: what the worker half hands vLLM each interval."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_kvcodec.stats import summarize


@dataclasses.dataclass
class KVCodecTransferStats(KVConnectorStats):
    """What vLLM's ``KVConnectorLogging`` receives from the worker each interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVCodecTransferStats":
        merged = Counter(self.data)
        merged.update(other.data)
        return KVCodecTransferStats(data=dict(merged))

    def reduce(self) -> dict[str, Any]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
