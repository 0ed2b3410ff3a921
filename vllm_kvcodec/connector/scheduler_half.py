"""Scheduler half: vLLM's scheduler-side calls, each handed to the part of the connector that answers it.

Runs in vLLM's scheduler process; never touches KV memory. It keeps one
:class:`~.request_state.RequestState` per request (its key chain, blocks and
what became of its loads and saves) and coordinates:

- :mod:`~.load_planner`: how many tokens past vLLM's local prefix cache a
  request can load (lookups inline or on the lookup thread, through
  :mod:`~.store_queries`), its load plan once vLLM allocated its blocks, what
  fetches ahead, and what a load's outcome teaches (the ledger of loads in
  flight and failed, evictions from vLLM's prefix cache);
- :mod:`~.save_planner`: which chunks (and, with ``block_hits``, prompt and
  finishing tails) to save, once, and again when a save did not land.

With ``block_hits`` (the default) a hit ends where vLLM's own prefix cache
would end, so the engine computes the same tokens it computes when its own
cache serves the prefix (see docs/architecture.md, "Where a hit ends"). Block
ids come per vLLM KV cache group (the hybrid manager's groups, see
:mod:`~.cache_groups`): loads write each group's allocated blocks (a
sliding-window group's window only), saves gather each group's blocks of the
chunk in the step that completes it. The workers' reports
(:class:`~.metadata.KVCodecWorkerReport`) close the loop: load outcomes,
save outcomes, the save queue's room, their background work and the LoRA
adapters they loaded.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm_kvcodec.connector.background_work import KeepStepping
from vllm_kvcodec.connector.cache_groups import CacheGroups
from vllm_kvcodec.connector.cache_identity import agreed_scales, is_fp8
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.connector.kv_events import StoreEvents
from vllm_kvcodec.connector.load_planner import LoadPlanner
from vllm_kvcodec.connector.lora_keys import AdapterKeys
from vllm_kvcodec.connector.metadata import KVCodecMetadata, KVCodecWorkerReport
from vllm_kvcodec.connector.precisions import Precisions
from vllm_kvcodec.connector.request_state import Keying, RequestState
from vllm_kvcodec.connector.save_planner import SavePlanner
from vllm_kvcodec.connector.store_access import open_connector_store
from vllm_kvcodec.connector.store_queries import StoreQueries
from vllm_kvcodec.errors import ConfigError
from vllm_kvcodec.keys.chain import Namespace
from vllm_kvcodec.keys.token_digests import digest_unit
from vllm_kvcodec.plans.outcomes import LoadOutcome
from vllm_kvcodec.save.precision_choice import merge_costs
from vllm_kvcodec.stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvcodec")


class SchedulerHalf:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, groups: int, tp_size: int,
                 cache_groups: CacheGroups, loaders: int = 1) -> None:
        """``loaders``: the workers that run each load and report its outcome (see load_ledger.py)."""
        self.config, self.groups, self.tp_size, self.cache_groups = config, groups, tp_size, cache_groups
        self.block_sizes = cache_groups.block_sizes
        self.chunk = config.chunk_size
        self.store = open_connector_store(config)
        self.stats = ConnectorStats()
        self.adapters = AdapterKeys(self.stats)
        self.keying = Keying(namespace, self.chunk, digest_unit(cache_groups.hit_alignment, self.chunk), cache_groups,
                             self.adapters, self.stats, config.block_hits, Precisions.from_config(config))
        self.keep_stepping = KeepStepping(config.shutdown_flush_s)  # for the workers' saves and upgrades in flight
        self.requests: dict[str, RequestState] = {}
        queries = StoreQueries(self.store, self.keying.namespace_of, tp_size, groups, self.chunk, self.stats)
        self.loads = LoadPlanner(config, self.keying, self.requests, queries, loaders)
        self.saves = SavePlanner(config, self.keying, self.requests, self.loads.ledger, self.store)
        self.namespace, self.digest_unit = namespace, self.keying.digest_unit
        self.ledger, self.lookups, self.lookup_mode = self.loads.ledger, self.loads.lookups, self.loads.lookup_mode
        # fp8 caches are keyed with their layers' scales, which only the workers know (adopt_handshake).
        self._awaiting_identity = is_fp8(namespace.dtype)

    @property
    def events(self) -> StoreEvents:
        return self.loads.events

    @events.setter
    def events(self, events: StoreEvents) -> None:
        """The KV events vLLM publishes (the facade turns them on): loads and saves both report to them."""
        self.loads.events = self.saves.events = events

    def adopt_handshake(self, handshakes: dict[int, Any]) -> None:
        """The workers' KV cache identity (fp8 scales): completes the namespace before any request is keyed."""
        self.namespace = self.keying.namespace = dataclasses.replace(self.namespace, kv_scales=agreed_scales(handshakes))
        costs = None
        for handshake in handshakes.values():
            costs = merge_costs(costs, getattr(handshake, "read_costs", None))
        self._read_costs(costs)
        digests = {h.namespace_digest for h in handshakes.values()}
        if digests != {self.namespace.digest}:
            raise ConfigError(f"kvcodec: workers key chunks under namespace {sorted(digests)}, the scheduler under "
                              f"{self.namespace.digest}; their configurations differ")
        self._awaiting_identity = False

    def _identity_known(self) -> bool:
        """False until the workers' handshake told an fp8 cache's scales: no key can be made before (counted)."""
        if self._awaiting_identity:
            self.stats.add(requests_before_cache_identity=1)
            logger.warning("kvcodec: no KV cache identity from the workers yet (fp8 scales); not caching this request")
        return not self._awaiting_identity

    # ---- vLLM's calls ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests[request.request_id] = RequestState.new(request, self.keying)
        state.follow_session()
        if state.identity is None or not self._identity_known():
            state.local_tokens = num_computed_tokens
            return 0, False
        return self.loads.matched_tokens(state, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if (state := self.requests.get(request.request_id)) is not None:
            self.loads.plan(state, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCodecMetadata:
        idle = not scheduler_output.total_num_scheduled_tokens
        self.keep_stepping.step(idle)
        self.loads.flush_lookups(idle)
        meta = KVCodecMetadata(idle=idle)
        self.loads.plan_step(meta, scheduler_output)
        self._scheduled(scheduler_output)
        if self.config.save and not self._awaiting_identity:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                if (state := self.requests.get(req_id)) is not None:
                    meta.saves.extend(self.saves.plan(state, n))
        finishing = self.saves.take_finishing()
        meta.saves.extend(finishing)
        meta.finishing = [s.req_id for s in finishing]
        return meta

    def _scheduled(self, out: "SchedulerOutput") -> None:
        """Each scheduled request's blocks and computed tokens, as vLLM's output for the step says."""
        for new in out.scheduled_new_reqs:
            if (state := self.requests.get(new.req_id)) is not None:
                state.scheduled(new.block_ids, new.num_computed_tokens, anew=True)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (state := self.requests.get(req_id)) is not None:
                state.scheduled(cached.new_block_ids[i], cached.num_computed_tokens[i],
                                anew=req_id in cached.resumed_req_ids)
        for req_id in out.num_scheduled_tokens:
            if (state := self.requests.get(req_id)) is not None and state.lossy_from is not None:
                self.loads.lossy.mark(state)  # the KV it computes over lossy KV is lossy too

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self.loads.kv_cache_manager = kv_cache_manager

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, KVCodecWorkerReport):
            return
        if report.adapters:
            self._adapters_loaded(report.adapters)
        for req_id, outcome in report.loads.items():
            self._load_settled(req_id, outcome)
        for save in report.saves:
            if not save.load_failed:  # one of its loads failed: settled with that load (SavePlanner.load_failed)
                self.saves.settled(save)
        if report.save_room is not None:
            self.saves.room_freed(report.save_room)
        self._read_costs(report.read_costs)
        self.keep_stepping.reported(report.background)

    def _read_costs(self, costs: dict[str, float] | None) -> None:
        """The workers' latest expected seconds per raw byte of each precision's loads (precision auto chooses by
        them; a report holds the slowest figure of the workers that told in its step)."""
        if costs:
            self.loads.read_costs = {**(self.loads.read_costs or {}), **costs}

    def _adapters_loaded(self, loads: dict[int, str]) -> None:
        """The workers (re)loaded these LoRA adapters: later requests are keyed by the files they read. A request
        keyed by other weights is cached no further, a streaming session's later turns included: its KV so far
        may come from either (the workers would refuse its loads and saves anyway)."""
        self.adapters.adopt(loads)
        for state in self.requests.values():
            state.adapter_reloaded_elsewhere(loads)

    def _load_settled(self, req_id: str, outcome: LoadOutcome) -> None:
        """A load every worker reported: a failure is settled on both sides, and in the request that loaded."""
        settled = self.loads.settle(req_id, outcome)
        if settled is None or not settled.outcome.failed:
            return
        self.saves.load_failed(settled.outcome.failed, settled.load.resting if settled.load is not None else [])
        if settled.state is not None:
            settled.state.load_failed(settled.outcome.failed)

    def request_finished(self, request: "Request") -> bool:
        """Forget the request; True when vLLM must hold its blocks until its finishing tail is gathered."""
        state = self.requests.pop(request.request_id, None)  # its load, if in flight, stays in the ledger
        self.loads.request_finished(state, request.request_id)
        return self.saves.request_finished(state, request.request_id, may_save=not self._awaiting_identity)

    # ---- the connector's own calls --------------------------------------------------
    def forget_store(self) -> None:
        """Forget what this instance learnt of the store: the chunks it saved (claims) and those whose loads failed.
        The next request then looks every chunk up and saves what it computes, as a fresh instance would."""
        self.saves.forget_store()
        self.ledger.forget_failures()

    def state(self) -> dict[str, Any]:
        """What is held between steps (tests check it is empty once the engine is)."""
        held = {"requests": list(self.requests), **self.loads.held(), **self.saves.held()}
        order = ("requests", "pending_loads", "inflight_loads", "awaiting_room", "waiters", "lookups", "prefetches",
                 "finishing")
        return {k: held[k] for k in order}

    def shutdown(self) -> None:
        self.loads.shutdown()
        self.store.close()
