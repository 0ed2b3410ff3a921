"""The precisions an engine stores and reads: its ``precision`` setting resolved for the model, each precision's key
namespace, and what a request asks for.

``lossless`` (the default) is one namespace, the engine's own, as ever. A
lossy level (``int8``, ``int6``, ``int4``; LOSSY: NOT BIT-EXACT) is a
namespace of its own, the level and what it keeps exact in its digest, of
canonical objects whatever the engine's page objects (the quantiser reads
keys per channel and values per token: it needs K and V apart): a lossless
reader never computes its keys. ``auto`` keys every request in the lossless
namespace, which lookups check (the ground truth), and stores a lossy variant
of each object beside it, at ``precision_floor``, under the same chunk hash
in the variant's namespace: a load reads the variant where the lossless
object would not arrive in time (:mod:`vllm_kvcodec.save.precision_choice`).

A request on a lossy server may demand lossless through vLLM's
``kv_transfer_params`` (``{"kvcodec_precision": "lossless"}``): it is keyed
in the lossless namespace, so its loads and saves are exactly those of a
lossless server, and it never takes KV from vLLM's prefix cache that a lossy
load wrote (:mod:`~.lossy_blocks`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm_kvcodec.codecs.precision import AUTO, LOSSLESS, LOSSY_LABEL, Precision
from vllm_kvcodec.connector.cache_identity import is_fp8
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.keys.chain import Namespace
from vllm_kvcodec.paged.base import CANONICAL_NAMESPACE

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvcodec")
#: ``kv_transfer_params`` fields a request may set: the precision it demands (``lossless``), and how long its load
#: may take under ``precision: auto`` (seconds).
DEMAND, BUDGET = "kvcodec_precision", "kvcodec_load_budget_s"
DEFAULT_FLOOR = "int8"


def resolve_precision(config: ConnectorConfig, dtype: str, num_layers: int, use_mla: bool) -> ConnectorConfig:
    """``config`` with its precision checked against the model: an fp8 cache stays lossless (it is 8-bit already,
    said in the log); MLA's latent (no K and V to quantise apart) and more full layers than the model has are a
    one-line ConfigError."""
    if config.precision == LOSSLESS:
        return config
    if is_fp8(dtype):
        logger.info("kvcodec: precision %s: the %s KV cache is 8-bit already; stored lossless as today",
                    config.precision, dtype)
        return config.model_copy(update={"precision": LOSSLESS, "precision_floor": None, "precision_sink_tokens": 0,
                                         "precision_full_layers": 0})
    if use_mla:
        raise ConfigError(f"precision {config.precision} quantises keys and values apart; MLA's latent KV cache "
                          "holds neither: use precision lossless")
    if config.precision_full_layers > num_layers:
        raise ConfigError(f"precision_full_layers {config.precision_full_layers} exceeds the model's {num_layers} "
                          "layers")
    return config


@dataclasses.dataclass(frozen=True)
class Precisions:
    """An engine's resolved ``precision``: what requests are keyed in, and the lossy level it stores, if any."""

    setting: str = LOSSLESS  # lossless, int8, int6, int4 or auto
    level: Precision | None = None  # the lossy level stored (auto: the variant, at precision_floor)
    load_budget_s: float = 1.0

    @classmethod
    def from_config(cls, config: ConnectorConfig) -> "Precisions":
        if config.precision == LOSSLESS:
            return cls(load_budget_s=config.precision_load_budget_s)
        name = (config.precision_floor or DEFAULT_FLOOR) if config.precision == AUTO else config.precision
        level = Precision(name, config.precision_sink_tokens, config.precision_full_layers)
        return cls(config.precision, level, config.precision_load_budget_s)

    @property
    def variant(self) -> str | None:
        """auto's lossy variant (the level name); None where nothing is stored twice."""
        return self.level.name if self.setting == AUTO and self.level is not None else None

    def names(self) -> list[str]:
        """Every precision whose namespace this engine reads or writes: lossless always (a request may demand it)."""
        return [LOSSLESS] + ([self.level.name] if self.level is not None else [])

    def namespace(self, base: Namespace, name: str) -> Namespace:
        """Where objects of precision ``name`` live: ``base`` for lossless (and auto's keys), else the level's
        namespace of canonical objects."""
        if name in (LOSSLESS, AUTO):
            return base
        if self.level is None or name != self.level.name:
            raise ValueError(f"this engine stores no {name} objects")
        return dataclasses.replace(base, precision=self.level.key(), layout_id=CANONICAL_NAMESPACE)

    def label(self) -> str:
        """The setting as the log shows it (a lossy one labelled so)."""
        if self.level is None:
            return LOSSLESS
        stored = self.level.key()
        what = f"auto (lossless, and a {stored} variant)" if self.setting == AUTO else stored
        return f"{what} ({LOSSY_LABEL})"

    def of_request(self, request: "Request") -> tuple[str, float]:
        """The precision ``request`` is keyed in (the setting, or lossless where it demands it) and its load budget."""
        params: dict[str, Any] = getattr(request, "kv_transfer_params", None) or {}
        name, budget = self.setting, self.load_budget_s
        demand = params.get(DEMAND)
        if demand is not None:
            if str(demand).lower() == LOSSLESS:
                name = LOSSLESS
            elif str(demand).lower() != self.setting:
                _warn_once(f"{DEMAND} {demand!r}: a request may only demand lossless; served as {self.setting}")
        if BUDGET in params:
            try:
                asked = float(params[BUDGET])
            except (TypeError, ValueError):
                asked = 0.0
            if asked > 0:
                budget = asked
            else:
                _warn_once(f"{BUDGET} {params[BUDGET]!r} is not a positive number of seconds; ignored")
        return name, budget


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A request's bad field is the client's mistake, not the engine's: one warning per distinct message."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("kvcodec: %s", message)
