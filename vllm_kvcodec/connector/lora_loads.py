"""Which files each LoRA adapter this worker runs was read from: what its chunks may be keyed by.

Only the worker knows which weights it runs for an adapter id: vLLM reads the
files in ``WorkerLoRAManager._load_adapter``, lazily and again after an
eviction or for ``load_inplace``, and the scheduler half keys requests before
that (see :mod:`~.lora_keys`). vLLM offers no hook there, so
:func:`watch_adapter_loads` wraps that method once per process: each load
fingerprints the adapter's files before and after vLLM reads them (equal: the
weights are those files; not, or unreadable: unknown, ""). The worker half
reports every load to the scheduler half (:meth:`LoadedAdapters.new_loads`)
and refuses any load or save whose keys name other weights than those
registered for the adapter id right now (:meth:`LoadedAdapters.running`). Should
a vLLM version lack the method, nothing is recorded and every LoRA request's
loads and saves are refused (logged): its KV is recomputed, never wrong.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from typing import Any

from vllm_kvcodec.keys.identity import adapter_files

logger = logging.getLogger("vllm_kvcodec")
#: Per vLLM worker LoRA manager: adapter id -> (load number, fingerprint of the files it was read from, or "").
_LOADS: "weakref.WeakKeyDictionary[Any, dict[int, tuple[int, str]]]" = weakref.WeakKeyDictionary()
_LOAD_NUMBERS = itertools.count(1)


def watch_adapter_loads() -> bool:
    """Wrap vLLM's adapter load so that every load is recorded (idempotent); False when vLLM has no such method."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    load = getattr(WorkerLoRAManager, "_load_adapter", None)
    if load is None:
        logger.warning("kvcodec: vLLM's WorkerLoRAManager has no _load_adapter to watch; requests with a LoRA adapter "
                       "are neither loaded nor saved")
        return False
    if getattr(load, "kvcodec_watched", False):
        return True

    @functools.wraps(load)
    def watched(manager: Any, lora_request: Any) -> Any:
        before = adapter_files(lora_request.lora_path)
        lora = load(manager, lora_request)
        after = adapter_files(lora_request.lora_path)
        record = (next(_LOAD_NUMBERS), before if before is not None and before == after else "")
        _LOADS.setdefault(manager, {})[lora_request.lora_int_id] = record
        return lora

    watched.kvcodec_watched = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = watched  # type: ignore[method-assign]
    return True


class LoadedAdapters:
    """The adapters of the engine whose LoRA config is ``lora_config`` (its worker's manager holds that object)."""

    def __init__(self, lora_config: Any) -> None:
        self._config = lora_config
        self._reported = 0  # the last load number reported

    def running(self, lora_id: int) -> str | None:
        """The fingerprint of the files the weights registered for ``lora_id`` now were read from ("": unknown);
        None when none are registered (not loaded yet, or evicted: the next load reads the files again)."""
        manager = self._manager()
        if manager is None or lora_id not in manager.list_adapters():
            return None
        record = _LOADS[manager].get(lora_id)
        return record[1] if record is not None else ""

    def new_loads(self) -> dict[int, str]:
        """Per adapter id, the fingerprint of its latest load since the last call ("": unknown)."""
        manager = self._manager()
        loads = _LOADS.get(manager, {}) if manager is not None else {}
        new = {lora_id: weights for lora_id, (number, weights) in loads.items() if number > self._reported}
        self._reported = max([self._reported] + [number for number, _ in loads.values()])
        return new

    def _manager(self) -> Any:
        return next((m for m in list(_LOADS) if getattr(m, "lora_config", None) is self._config), None)
