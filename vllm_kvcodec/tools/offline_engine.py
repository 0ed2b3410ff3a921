"""The step an offline ``vllm.LLM`` in this process owes a finished request.

vLLM's engine core steps once more after a request finishes (it tells the
workers, and a connector may hold the request's blocks until then:
``delay_free_blocks``). Served engines (``vllm serve``, an ``LLM`` whose engine
core runs in its own process) take that step by themselves; an ``LLM`` whose
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) takes it
only at its next ``generate``. With ``block_hits`` the connector saves a
finished request's finishing tail in that step, and vLLM refuses to reset its
prefix cache while blocks are held for it: tools that reset it between
requests take the step first.
"""

from __future__ import annotations

from typing import Any


def take_finishing_step(llm: Any) -> None:
    """Run the pending step of an in-process engine core; nothing for one in its own process (it runs it)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient holds the EngineCore itself
    if core is not None and core.scheduler.has_requests():
        llm.llm_engine.step()
