"""Each request's prompt tokens by source, as vLLM's own scheduler counted them: a line per request, for replays.

vLLM counts, when it first schedules a request, the prompt tokens its local
prefix cache holds and those a KV connector will load (``PrefillStats``:
``num_local_cached_tokens``, ``num_external_cached_tokens``), but publishes
them only summed (``vllm:prompt_tokens_by_source``). ``kvcodec bench trace``
needs them per request, to hold the simulator to each one, so its workers run
this scheduler (``--scheduler-cls``): vLLM's, plus one JSON line per request
to the file ``KVCODEC_REQUEST_LEDGER`` names when the request is first
scheduled. It reads what vLLM set and changes nothing. (vLLM on CPUs runs its
synchronous scheduler; this is a subclass of that one.)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

LEDGER_ENV = "KVCODEC_REQUEST_LEDGER"
SCHEDULER_CLS = f"{__name__}.LedgerScheduler"


class LedgerScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(LEDGER_ENV)
        self._ledger = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115 - lives as long as the engine
        self._written: set[str] = set()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        if self._ledger is not None:
            for new in out.scheduled_new_reqs:
                self._write(new.req_id)
        return out

    def _write(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        stats = getattr(request, "prefill_stats", None)
        if request is None or stats is None or req_id in self._written or request.num_preemptions > 0:
            return
        self._written.add(req_id)
        self._ledger.write(json.dumps({"request_id": req_id, "prompt": request.num_prompt_tokens,
                                       "local": stats.num_local_cached_tokens,
                                       "external": stats.num_external_cached_tokens, "t": time.time()}) + "\n")

    def shutdown(self) -> None:
        super().shutdown()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines a worker wrote (none if it wrote no file)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
