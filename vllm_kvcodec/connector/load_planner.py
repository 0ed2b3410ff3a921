"""The load side of the scheduler half: lookup answers, load plans, what their outcomes teach, and prefetches.

A request asks how much of its prompt the store holds (a question per
request, asked again only after a preemption; answered inline or by the
lookup thread, batched over the step's requests: :mod:`~.lookup`). Its
answer is the longest stored prefix in whole chunks and, with
``block_hits``, the longest stored whole-block prefix after it, so a hit ends
where vLLM's own prefix cache would end. A chunk in flight for another
request, or one whose load failed, is not offered (:mod:`~.load_ledger`).
Once vLLM allocated its blocks, the hit becomes a :class:`LoadSpec` of slot
mappings per KV cache group (a sliding-window group's window only).

A failed load marks its chunks failed, so no lookup offers them again until
they are replaced, and *evicts* the loading request's blocks from the failed
one on from vLLM's prefix cache: under vLLM's ``recompute`` policy those
blocks keep their prefix hashes, and a request aborted before its recompute
would otherwise leave KV that was never written to be served as a local hit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.connector.kv_events import StoreEvents
from vllm_kvcodec.connector.load_ledger import InflightLoad, LoadLedger
from vllm_kvcodec.connector.lookup import Answer, AsyncLookup, Question, Tail, answer_questions, tail_candidates
from vllm_kvcodec.connector.lookup_budget import LookupBudget
from vllm_kvcodec.connector.lossy_blocks import LossyBlocks
from vllm_kvcodec.connector.metadata import KVCodecMetadata
from vllm_kvcodec.connector.request_state import Keying, RequestState
from vllm_kvcodec.connector.store_queries import StoreQueries
from vllm_kvcodec.codecs.precision import AUTO, LOSSLESS
from vllm_kvcodec.keys.chain import tail_position
from vllm_kvcodec.paged.slots import slots_for_tokens
from vllm_kvcodec.plans.loads import ChunkLoad, LoadSpec, PrefetchSpec
from vllm_kvcodec.plans.outcomes import LoadOutcome
from vllm_kvcodec.plans.spans import Span
from vllm_kvcodec.save.precision_choice import variant_from

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger("vllm_kvcodec")
#: Slack beyond the load timeout before a load that never reported stops holding other requests back.
INFLIGHT_SLACK_S = 10.0
#: How long a step with nothing scheduled waits for lookups in the air (their answers admit the next requests).
LOOKUP_IDLE_WAIT_S = 0.01


class SettledLoad(NamedTuple):
    """A load every worker reported: what it was (None: not known here), its merged outcome, and the request it
    was for, if that request still runs (not a new request under its id)."""

    load: InflightLoad | None
    outcome: LoadOutcome
    state: RequestState | None


class LoadPlanner:
    def __init__(self, config: ConnectorConfig, keying: Keying, requests: dict[str, RequestState],
                 queries: StoreQueries, loaders: int) -> None:
        """``requests``: the scheduler half's requests, by id; ``loaders``: the workers that run each load."""
        self.config, self.keying, self.requests, self.queries = config, keying, requests, queries
        self.stats = keying.stats
        self.chunk = config.chunk_size
        self.ledger = LoadLedger(inflight_ttl_s=config.load_timeout_s + INFLIGHT_SLACK_S, loaders=loaders)
        self.events = StoreEvents.off()  # the facade turns them on when vLLM publishes KV events
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM after construction
        self.lookup_mode = config.lookup_mode()
        self.lookups = self._lookup_thread() if self.lookup_mode != "sync" and config.load else None
        self.prefetches = config.prefetches()
        self._to_prefetch: dict[str, None] = {}  # answered with a hit, not loaded yet: fetched ahead if it waits
        self._prefetch_done: list[str] = []  # requests whose objects fetched ahead the worker may drop
        self._pending: list[LoadSpec] = []  # planned since the last step's plan
        self._settled: dict[int, bool] = {}  # loads every worker reported since the last plan -> failed
        self.lossy = LossyBlocks(keying.cache_groups.block_sizes, self.stats)  # blocks lossy loads wrote, and after
        #: precision auto: the workers' expected seconds per raw byte of each precision's loads (their reports)
        self.read_costs: dict[str, float] | None = None

    def _lookup_thread(self) -> AsyncLookup:
        """The lookup thread; with ``auto`` (adaptive), waited for within a step's budget while lookups fit it,
        measured from the start with empty existence checks (a chunk key no prompt has)."""
        budget, probe = None, None
        if self.lookup_mode == "adaptive":
            budget = LookupBudget(self.stats, floor_s=self.config.lookup_budget_ms / 1e3,
                                  share=self.config.lookup_budget_share)
            probe = self.queries.probe()
        return AsyncLookup(self.queries.stored, self.queries.resolve, self.stats,
                           timeout_s=self.config.lookup_timeout_s, max_batches=self.config.lookup_queue,
                           budget=budget, probe=probe)

    # ---- lookup ---------------------------------------------------------------------
    def matched_tokens(self, state: RequestState, local_tokens: int) -> tuple[int | None, bool]:
        """vLLM's question: how many tokens past its local hit the request can load (None: ask again next step)."""
        state.local_tokens = local_tokens
        if self.lossy.screen(state, self.kv_cache_manager):
            return None, False  # it demands lossless and its local hit held lossy blocks, evicted: vLLM looks again
        loadable = state.loadable()
        if not state.looked_up:
            answer = self._look_up(state, loadable)
            if answer is None:
                return None, False  # asked in the background: vLLM asks again next step
            self._answered(state, answer, len(loadable))
        hit = min(state.hit_chunks, self.ledger.first_failed(loadable))
        tail = self.usable_tail(state, hit)
        end = hit * self.chunk + (tail.tokens if tail else 0)
        if self._reads_inflight(state, loadable, max(end, local_tokens)):
            self.stats.add(lookups_waiting_for_inflight_load=1)
            return None, False  # ask again next step, when that load has an outcome
        n = max(0, end - local_tokens)
        return n, bool(n) and self.config.load_mode == "async"

    def _answered(self, state: RequestState, answer: Answer, asked: int) -> None:
        state.hit_chunks, state.tail, state.looked_up = answer.hit, answer.tail, True
        if self.prefetches and (answer.hit or answer.tail):
            self._to_prefetch[state.req_id] = None
        stored = answer.hit + self._next_stored(state, answer)
        state.next_save = min(state.next_save, stored) if state.computed else stored
        self.stats.add(lookups=1, lookup_chunks=asked, hit_chunks=answer.hit,
                       **({"hit_tail_tokens": answer.tail.tokens} if answer.tail else {}))

    def _next_stored(self, state: RequestState, answer: Answer) -> int:
        """1 when the chunk holding the prompt's last token is stored whole and not known to fail: the request
        computes it (vLLM computes the last token) but does not save it again. Saved again, it would cost an
        encode and a put, and replace the first writer's object with KV computed in another schedule of steps,
        whose bf16 bits can differ in the last place."""
        if not answer.next_stored or self.ledger.first_failed(state.hashes[answer.hit : answer.hit + 1]) == 0:
            return 0
        self.stats.add(saves_already_stored=1)
        return 1

    def usable_tail(self, state: RequestState, hit: int) -> Tail | None:
        """The stored tail, if every full chunk before it is still a hit and it is not known to fail."""
        tail = state.tail
        if tail is None or hit != tail.index or self.ledger.first_failed([tail.chunk_hash]) == 0:
            return None
        return tail

    def _look_up(self, state: RequestState, loadable: list[str]) -> Answer | None:
        """The longest stored prefix in whole chunks, then (``block_hits``) the longest stored block prefix after it.

        Inline (``lookup`` sync), or asked of the lookup thread (async:
        None until its answer is in, see :mod:`~.lookup`). A replay finds its
        own tail after its last full chunk; the next turn of a chat finds the
        last turn's after the chunks they share, however much it added.
        """
        if not self.config.load:
            return Answer(0)
        full = state.request.num_tokens // self.chunk
        next_chunk = state.chunk_hashes(full)[len(loadable)] if full > len(loadable) else None
        tails = None
        if self.config.block_hits and state.identity is not None:
            tokens = list(state.request.all_token_ids)  # a snapshot: the lookup thread hashes it
            namespace, identity, align = state.namespace, state.identity, self.keying.alignment

            def tails(hit: int) -> list[Tail]:
                return tail_candidates(namespace, tokens, identity, loadable[:hit], self.chunk, align)

            if not loadable and not tails(0) and next_chunk is None:
                return Answer(0)  # nothing the store could hold: no question to ask
        elif not loadable and next_chunk is None:
            return Answer(0)
        question = Question(loadable, tails, next_chunk, state.keyed_in)
        if self.lookups is None:
            return answer_questions([question], self.queries.stored, self.queries.resolve)[0]
        key = (tuple(loadable), next_chunk, state.identity,
               tuple(tokens[len(loadable) * self.chunk:]) if tails else None)
        return self.lookups.ask(state.req_id, key, question)

    def _reads_inflight(self, state: RequestState, loadable: list[str], tokens: int) -> bool:
        """Whether the chunks of its first ``tokens`` (local hit and load) are being loaded by some request.

        With ``block_hits`` that includes any tail in flight after any of
        those chunks' predecessors, whatever its length (in-flight tails are
        tracked under their position as well as their key): its blocks may be
        part of this request's local hit.
        """
        reads = -(-tokens // self.chunk)
        busy = state.hashes[: min(reads, len(loadable))]
        if self.config.block_hits and state.identity is not None:
            busy += [tail_position(state.namespace, loadable[:k], state.identity)
                     for k in range(min(reads, len(loadable) + 1))]
        return self.ledger.busy(busy) or self._local_hit_inflight(state)

    def _local_hit_inflight(self, state: RequestState) -> bool:
        """Whether a load in flight writes any block vLLM is about to give the request as its local hit.

        The chunk keys above miss a prompt that diverges inside a chunk being
        loaded: its key for the chunk differs, yet vLLM's prefix cache, block
        by block, hands it the loading request's blocks up to where it
        diverges (a sync load's blocks are registered at allocation). Under
        async scheduling it would compute over them before the load's failure
        is reported, and vLLM would not rewind it.

        The blocks are what vLLM's scheduler got from ``get_computed_blocks``
        just before asking, nothing having changed since: the same call of its
        KV cache coordinator's ``find_longest_cache_hit``, with the same
        arguments (exact, and free of ``get_computed_blocks``' side effects,
        such as its KV events), cut to the local hit it offered us
        (:meth:`~.request_state.RequestState.local_hit_blocks`). Its cost is
        vLLM's own lookup of the local hit again, paid only while some load
        writes blocks. Under sync scheduling vLLM would rewind such a request
        itself; waiting there too costs it a step and spares it computing over
        a load that fails.
        """
        manager = self.kv_cache_manager
        if not state.local_tokens or manager is None or not self.ledger.writing_any():
            return False
        return self.ledger.writes_any(state.local_hit_blocks(manager))

    # ---- load plans -----------------------------------------------------------------
    def plan(self, state: RequestState, blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: plan the load of its ``num_external_tokens`` past the local hit."""
        state.block_ids = [list(g) for g in blocks.get_block_ids()]
        if num_external_tokens <= 0:
            return
        start = state.local_tokens
        numbered = self._chunk_loads(state, start, start + num_external_tokens)
        chunks = list(numbered.values())
        first_tokens = {c.chunk_hash: max(start, n * self.chunk) for n, c in numbered.items()}  # where eviction starts
        busy = [c.chunk_hash for c in chunks]
        if state.tail is not None and chunks and chunks[-1].chunk_hash == state.tail.chunk_hash:  # also busy under
            # its position (see _reads_inflight)
            busy.append(tail_position(state.namespace, state.hashes[: state.tail.index], state.identity))
        sizes = self.keying.cache_groups.block_sizes
        writes = [{s // bs for c in chunks for s in c.spans[g].slots} for g, bs in enumerate(sizes)]
        load_id = self.ledger.start(state.req_id, busy, first_tokens, state.block_ids, writes)
        state.loads.add(load_id)
        lossy = [first_tokens[c.chunk_hash] for c in chunks if c.precisions[0] != LOSSLESS]
        if lossy:
            state.holds_lossy(min(lossy))
            self.lossy.mark(state)  # a sync load's blocks are in vLLM's prefix cache from now on
        self._pending.append(LoadSpec(state.req_id, chunks, is_async=self.config.load_mode == "async",
                                      load_id=load_id, adapter=state.adapter))
        self.events.loading(load_id, state.request, chunks, state.hashes, state.tail, self.chunk)

    def _chunk_loads(self, state: RequestState, start: int, end: int) -> dict[int, ChunkLoad]:
        """Per chunk of ``[start, end)`` (by its number), each group's allocated blocks there (a window group's
        window only); chunks with none are left out, so the loads' positions are not their chunks' numbers."""
        loads = {}
        tail, sizes = state.tail, self.keying.cache_groups.block_sizes
        for c in range(start // self.chunk, -(-end // self.chunk)):
            a, b = max(start, c * self.chunk), min(end, (c + 1) * self.chunk)
            spans = [_span(table, bs, a, b, c * self.chunk) for table, bs in zip(state.block_ids, sizes)]
            blocks = sorted({s // bs for span, bs in zip(spans, sizes) for s in span.slots})
            if not blocks:  # nothing to write: a chunk left of every window group's window (all-window models)
                continue
            expect = state.digests(c, b - c * self.chunk)
            if tail is not None and c == tail.index:  # the load ends in the blocks found after the hit chunks
                held = tail.stored_tokens
                loads[c] = ChunkLoad(tail.chunk_hash, spans, blocks, object_tokens=held if held < self.chunk else None,
                                     expect=expect)
            else:
                loads[c] = ChunkLoad(state.hashes[c], spans, blocks, expect=expect)
        for load, precisions in zip(loads.values(), self._read_precisions(state, [c.tokens for c in loads.values()])):
            load.precisions = precisions
        return loads

    def _read_precisions(self, state: RequestState, tokens: list[int]) -> list[tuple[str, ...]]:
        """Where each chunk of a load (``tokens`` each, in order) is read from: the namespace the request is keyed
        in; under precision auto the lossy variant of its last chunks, then the lossless object, where the workers'
        measured reads would not bring the lossless load within the request's budget (save/precision_choice.py)."""
        variant = self.keying.precisions.variant
        if state.precision != AUTO or variant is None:
            return [(state.keyed_in,)] * len(tokens)
        per_token = self.keying.raw_bytes_per_token
        keep = variant_from([t * per_token for t in tokens], self.read_costs or {}, variant, state.load_budget_s)
        if keep < len(tokens):
            self.stats.add(precision_variant_chunks_planned=len(tokens) - keep)
        return [(LOSSLESS,)] * keep + [(variant, LOSSLESS)] * (len(tokens) - keep)

    # ---- per step -------------------------------------------------------------------
    def flush_lookups(self, idle: bool) -> None:
        """The step's lookups go to the thread as one batch, answered while the step runs."""
        if self.lookups is None:
            return
        self.lookups.flush(ran=not idle)
        if idle and self.lookups.in_flight():
            # Nothing runs, so waiting costs no request; without it vLLM steps again at once, and its loop
            # spins on the GIL the lookup thread needs between its store calls.
            self.lookups.wait_idle(LOOKUP_IDLE_WAIT_S)

    def plan_step(self, meta: KVCodecMetadata, out: "SchedulerOutput") -> None:
        """The step's loads, the verdicts of loads settled since the last step, and what to fetch ahead."""
        meta.loads, self._pending = self._pending, []
        meta.settled_loads, self._settled = self._settled, {}
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            if (state := self.requests.get(req_id)) is not None:
                state.looked_up = False  # its blocks are gone; the store may hold more by its resumption
        if self.prefetches:
            self._plan_prefetches(meta, out)

    def _plan_prefetches(self, meta: KVCodecMetadata, out: "SchedulerOutput") -> None:
        """Ask the worker to fetch ahead the hits of requests still waiting after their lookup, and to drop what it
        fetched for requests that were scheduled (their load took what it could), preempted or ended."""
        scheduled = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.req_ids)
        scheduled |= set(getattr(out, "preempted_req_ids", None) or ())
        for req_id in list(self._to_prefetch):
            del self._to_prefetch[req_id]
            state = self.requests.get(req_id)
            # Gone, scheduled, asking again, or allocated (an async load in flight): nothing to fetch ahead.
            if state is None or req_id in scheduled or not state.looked_up or state.block_ids:
                continue
            hit = min(state.hit_chunks, self.ledger.first_failed(state.hashes[: state.hit_chunks]))
            tail = self.usable_tail(state, hit)
            chunks = state.hashes[:hit] + ([tail.chunk_hash] if tail else [])
            if chunks:
                tokens = [self.chunk] * hit + ([tail.tokens] if tail else [])
                meta.prefetches.append(PrefetchSpec(req_id, chunks, self._read_precisions(state, tokens)))
                state.prefetching = True
        for req_id in scheduled:
            if (state := self.requests.get(req_id)) is not None and state.prefetching:
                state.prefetching = False
                self._prefetch_done.append(req_id)
        meta.prefetch_done, self._prefetch_done = self._prefetch_done, []

    # ---- outcomes -------------------------------------------------------------------
    def settle(self, req_id: str, outcome: LoadOutcome) -> SettledLoad | None:
        """Settle the load the outcome names (``load_id``) once every worker that runs it reported (a rank that
        ends it steps after another is heard then, with the same load): the request now bearing ``req_id`` may
        be a new one, whose own load stays in flight and whose hit this outcome says nothing about. A failure
        marks its chunks failed and evicts the blocks it wrote from vLLM's prefix cache. None: still in flight."""
        settled = self.ledger.report(outcome)
        if settled is None:
            return None  # some worker still runs it: still in flight, and its outcome still untold
        load, outcome = settled
        if outcome.load_id:
            self._settled[outcome.load_id] = bool(outcome.failed)  # the saves held for it are stored, or dropped
        state = self.requests.get(req_id)
        if state is not None and outcome.load_id in state.loads:
            state.loads.discard(outcome.load_id)
        else:
            state = None  # gone, or a new request under the id of the one whose load this was
        self.events.load_settled(outcome)
        if outcome.failed:
            self.ledger.mark_failed(outcome.failed)
            self.stats.add(failed_load_chunks=len(outcome.failed))
            if load is not None:
                self._evict_from(load.block_ids, min(load.first_tokens.get(h, 1 << 62) for h in outcome.failed))
        return SettledLoad(load, outcome, state)

    def _evict_from(self, block_ids: list[list[int]], first_token: int) -> None:
        """Take every group's blocks from ``first_token`` on out of vLLM's prefix cache (they keep their refcounts).

        They held KV that failed to arrive, or KV computed after it: never a
        local hit, whether the request recomputes them or ends first.
        """
        sizes = self.keying.cache_groups.block_sizes
        blocks = {b for table, bs in zip(block_ids, sizes) for b in table[first_token // bs :] if b != 0}
        if blocks and self.kv_cache_manager is not None:
            self.kv_cache_manager.evict_blocks(blocks)
            self.stats.add(blocks_evicted_after_load_failure=len(blocks))

    # ---- end ------------------------------------------------------------------------
    def request_finished(self, state: RequestState | None, req_id: str) -> None:
        """Nobody waits for its lookup any more; what was fetched ahead for it goes (its load, if in flight, stays
        in the ledger until every worker reported it)."""
        if self.lookups is not None:
            self.lookups.forget(req_id)  # finished or aborted before its answer: nobody waits for it
        self._to_prefetch.pop(req_id, None)
        if state is not None and state.prefetching:
            self._prefetch_done.append(req_id)  # the worker drops what it fetched ahead (next plan)

    def held(self) -> dict[str, object]:
        """What is held between steps (see SchedulerHalf.state)."""
        return {"pending_loads": len(self._pending), "inflight_loads": self.ledger.inflight_requests(),
                "lookups": self.lookups.waiting() if self.lookups else [], "prefetches": list(self._to_prefetch)}

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.shutdown()


def _span(table: list[int], block_size: int, a: int, b: int, chunk_start: int) -> Span:
    """Tokens ``[a, b)`` in this group's non-null blocks: a suffix (vLLM nulls a window group's blocks from the left)."""
    first = a
    while first < b and table[first // block_size] == 0:
        first = (first // block_size + 1) * block_size
    first = min(first, b)
    slots = slots_for_tokens(table, block_size, first, b).tolist()
    return Span(first - chunk_start, slots)


__all__ = ["INFLIGHT_SLACK_S", "LoadPlanner", "SettledLoad"]
