"""What vLLM gives its OffloadingConnector and not the connector's secondary tiers: the engine's config, each request.

vLLM builds a secondary tier from an ``OffloadingConfig`` (the model's *name*,
the KV dtype, the row geometry) and hands it offload keys, never tokens. From
that alone a tier cannot tell two fine-tunes served from one path, or one model
under two ``hf_overrides``, apart, nor prove which tokens a stored row was
computed from. :class:`~vllm_kvcodec.offload_tier.connector.KVCodecOffloadingConnector`
opens an :class:`EngineContext` while vLLM builds its tiers, and announces each
new request through it, so that :class:`~vllm_kvcodec.offload_tier.KVCodecTier`
keys its rows by the connector's identity and records each row's tokens. A tier
built any other way refuses to start (:func:`current`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_kvcodec.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


class EngineContext:
    """One engine's config, and the requests being announced to its tiers (by id, only while announced)."""

    def __init__(self, vllm_config: "VllmConfig") -> None:
        self.vllm_config = vllm_config
        self._arriving: dict[str, "Request"] = {}

    @contextlib.contextmanager
    def announcing(self, request: "Request") -> Iterator[None]:
        """Make ``request`` known to the tiers while vLLM tells them of it (``on_new_request``)."""
        self._arriving[request.request_id] = request
        try:
            yield
        finally:
            self._arriving.pop(request.request_id, None)

    def arriving(self, req_id: str) -> "Request | None":
        return self._arriving.get(req_id)


_BUILDING: contextvars.ContextVar[EngineContext | None] = contextvars.ContextVar("kvcodec_offload_engine",
                                                                                   default=None)


@contextlib.contextmanager
def building(context: EngineContext) -> Iterator[EngineContext]:
    """The engine whose tiers vLLM builds inside this block."""
    token = _BUILDING.set(context)
    try:
        yield context
    finally:
        _BUILDING.reset(token)


def current() -> EngineContext:
    """The engine being built, or a one-line error: without it a tier could neither key nor prove its rows."""
    context = _BUILDING.get()
    if context is None:
        raise ConfigError("KVCodecTier needs the engine's model identity and each request's tokens, which vLLM gives "
                          "its connector only: set kv_connector to KVCodecOffloadingConnector with "
                          "kv_connector_module_path vllm_kvcodec.offload_tier (docs/tiers.md)")
    return context
