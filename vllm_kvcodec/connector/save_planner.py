"""The save side of the scheduler half: which chunks to gather and store, once, and again when a save did not land.

Every chunk that becomes full is saved, prompt or output, including chunks
completed across several steps of a chunked prefill; with ``block_hits`` (the
default) also each prompt's tail past its last full chunk (whole blocks, up to
the block holding the last token) and, when a request finishes, the part of
prompt and answer past their last full chunk (a chat's next turn). Each
object gets a ref per whole-block prefix (:mod:`~vllm_kvcodec.keys.block_refs`).

A burst of requests sharing a new prefix saves it once (:mod:`~.save_claims`);
the others wait on the claim and save it themselves if that save does not
land. A save that did not land (dropped, failed, or computed over a failed
load) releases its claim and is planned again while its request still holds
the blocks, a bounded number of times; one dropped for want of queue room
waits for a worker report whose room covers it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_kvcodec.codecs.precision import AUTO, LOSSLESS
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.connector.kv_events import StoreEvents
from vllm_kvcodec.connector.load_ledger import LoadLedger, RestingSave
from vllm_kvcodec.connector.request_state import TAIL, Keying, RequestState
from vllm_kvcodec.connector.save_claims import SaveClaims
from vllm_kvcodec.plans.outcomes import SaveOutcome
from vllm_kvcodec.plans.saves import SaveSpec

if TYPE_CHECKING:
    from storage import Store

#: Saves of one chunk one request may plan (the first, and retries after it did not land).
MAX_SAVE_ATTEMPTS = 3


def _finished_whole() -> frozenset[Any]:
    """Request statuses whose every step ran to its end (stop or length): their KV up to the last token is written."""
    from vllm.v1.request import RequestStatus

    return frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


class SavePlanner:
    def __init__(self, config: ConnectorConfig, keying: Keying, requests: dict[str, RequestState], ledger: LoadLedger,
                 store: "Store") -> None:
        """``requests``: the scheduler half's requests, by id; ``ledger``: the loads saves may rest on."""
        self.config, self.keying, self.requests, self.ledger, self.store = config, keying, requests, ledger, store
        self.stats = keying.stats
        self.chunk = config.chunk_size
        self.claims = SaveClaims()
        self.events = StoreEvents.off()  # the facade turns them on when vLLM publishes KV events
        self._awaiting_room: dict[str, None] = {}  # requests with saves dropped for want of queue room, oldest first
        self._waiters: dict[str, set[str]] = {}  # chunk hash -> requests that left its save to another's claim
        self._finishing: list[SaveSpec] = []  # finishing tails of requests vLLM ended (see _plan_finish)

    # ---- plans ----------------------------------------------------------------------
    def plan(self, state: RequestState, scheduled: int) -> list[SaveSpec]:
        """Every chunk that is full once this step has run: its tokens are known and its KV written.

        While the store is known to be down nothing is planned (no gather, no
        encode for a put that would fail): the chunks stay due, and are saved
        once it answers if the request still holds them, or by the next
        request that computes them.
        """
        if state.identity is None:
            return []
        full = min(state.computed + scheduled, state.request.num_tokens) // self.chunk
        if self.store.is_down:
            new = set(range(state.next_save, full)) - state.deferred
            state.deferred |= new
            self.stats.add(saves_deferred_store_down=len(new))
            return []
        hashes = state.chunk_hashes(full)
        saves = []
        for c in range(state.next_save, full):
            if state.save_attempts[c] >= MAX_SAVE_ATTEMPTS or c in state.awaiting_room:
                continue
            spec = self._claimed(state, hashes[c], c, self.chunk, wait=True)
            if spec is not None:
                state.save_attempts[c] += 1
                saves.append(spec)
        state.next_save = max(state.next_save, full)
        if self.keying.block_hits and not state.tail_planned and state.computed + scheduled >= state.request.num_prompt_tokens:
            saves.extend(self._plan_tail(state))
        return saves

    def _plan_tail(self, state: RequestState) -> list[SaveSpec]:
        """The prompt's tail, in the step that computes its last token: whole blocks past its last full chunk up to
        the block holding that token (what a replay of the prompt can load), if it has any and it was not loaded."""
        state.tail_planned = True
        prompt = state.request.num_prompt_tokens
        index, tokens = self._last_blocks(prompt)
        if (not tokens or state.save_attempts[TAIL] >= MAX_SAVE_ATTEMPTS or TAIL in state.awaiting_room
                or (index + 1) * self.chunk <= prompt  # its chunk is full, saved as a chunk: its refs name these blocks
                or self._loaded_tail_covers(state, index, tokens)):
            return []
        state.tail_save = state.tail_hash(index, tokens)  # planned again if this save, or another request's, fails
        spec = self._claimed(state, state.tail_save, index, tokens, wait=True)
        if spec is None:
            return []
        state.save_attempts[TAIL] += 1
        self.stats.add(tail_saves_planned=1)
        return [spec]

    def _plan_finish(self, state: RequestState) -> bool:
        """The finishing tail: prompt and answer past their last full chunk, whole blocks up to the last token's.

        What vLLM's own cache keeps of a finished request, and what the next
        turn of a chat shares; the full chunks of the answer were saved as
        they filled. Only for a request that ended by a stop or its length
        (an aborted one may have KV of unfinished steps), whose blocks hold KV
        that no failed load touched. vLLM holds the blocks until the worker
        reports the request as finished sending, after gathering the tail in
        the next step (its ``delay_free_blocks`` contract).
        """
        request = state.request
        if (not (self.config.save and self.keying.block_hits) or state.identity is None or self.store.is_down
                or not state.block_ids or state.failures_seen or request.status not in _finished_whole()):
            return False
        index, tokens = self._last_blocks(request.num_tokens)
        if not tokens or self._loaded_tail_covers(state, index, tokens):
            return False  # whole chunks only (saved as they filled), or loaded: their refs name these blocks
        chunk_hash = state.tail_hash(index, tokens)
        if chunk_hash == state.tail_save:
            return False  # the prompt's tail (an answer of no whole block)
        spec = self._claimed(state, chunk_hash, index, tokens, wait=False)
        if spec is None:
            return False  # another request saves it, or its blocks are gone
        self._finishing.append(spec)
        self.stats.add(finish_tail_saves_planned=1)
        return True

    def _claimed(self, state: RequestState, chunk_hash: str, index: int, tokens: int, *, wait: bool) -> SaveSpec | None:
        """The save of ``tokens`` tokens from chunk ``index``, if this request may make it: nobody else claimed it
        (else, ``wait``: it is left to that claim, and planned again here if that save does not land) and every
        group still holds its blocks (else whoever computes it next saves it). Not under precision auto where its
        KV may be lossy: a lossless object is the ground truth (see connector/lossy_blocks.py)."""
        first = index * self.chunk
        if state.precision == AUTO and state.lossy_from is not None and first + tokens > state.lossy_from:
            self.stats.add(saves_skipped_lossy_kv=1)
            return None
        if not self.claims.claim(chunk_hash):
            if wait:
                self._wait_for(state, chunk_hash)
            return None
        if not state.blocks_held(index, tokens):
            self.claims.release(chunk_hash)
            self.stats.add(saves_dropped_window_freed=1)  # a window group freed them: a retry cannot gather it
            return None
        self.events.saving(state.request, chunk_hash, first, tokens)
        self.ledger.rest(state.loads, state.req_id, chunk_hash)  # dropped if one of them fails
        return SaveSpec(state.req_id, chunk_hash, state.slots(first, tokens), sorted(state.loads),
                        state.refs(index, tokens), state.digests(index, tokens), state.adapter,
                        self._stored_as(state), first_chunk=index == 0)

    def _stored_as(self, state: RequestState) -> tuple[str, ...]:
        """The namespaces a save of ``state`` goes to: the one it is keyed in; under precision auto also the lossy
        variant's (its lookups find the lossless object, its loads may read either)."""
        variant = self.keying.precisions.variant
        if state.precision == AUTO and variant is not None:
            return (LOSSLESS, variant)
        return (state.keyed_in,)

    def _last_blocks(self, tokens: int) -> tuple[int, int]:
        """(chunk, tokens in it) of the whole blocks up to the one holding token ``tokens - 1``: where vLLM's own
        cache ends a hit of these tokens."""
        align = self.keying.alignment
        return divmod((tokens - 1) // align * align, self.chunk)

    @staticmethod
    def _loaded_tail_covers(state: RequestState, index: int, tokens: int) -> bool:
        """The tail it loaded holds these blocks: they have a ref already (that is how it was found)."""
        return state.tail is not None and state.tail.index == index and state.tail.tokens >= tokens

    def _wait_for(self, state: RequestState, chunk_hash: str) -> None:
        """Leave the chunk to the request saving it, but hear if that save does not land (see settled)."""
        self.stats.add(saves_deduplicated=1)
        state.waiting_on.add(chunk_hash)
        self._waiters.setdefault(chunk_hash, set()).add(state.req_id)

    def take_finishing(self) -> list[SaveSpec]:
        """The finishing tails planned since the last step (their requests ended after it was planned)."""
        finishing, self._finishing = self._finishing, []
        return finishing

    # ---- outcomes -------------------------------------------------------------------
    def settled(self, save: SaveOutcome) -> None:
        """A worker's outcome of a save: a landed chunk is whole again; one that did not land is planned again."""
        self.events.save_settled(save)
        waiters = self._waiters.pop(save.chunk_hash, set())
        if save.landed:
            self.ledger.replaced(save.chunk_hash)
            return
        self.claims.release(save.chunk_hash)
        # Requests that skipped the chunk for this save and still hold it save it instead: the one that claimed it
        # may have finished before its save failed (a burst's first request, an outage's last).
        for req_id in waiters - {save.req_id}:
            if (waiter := self.requests.get(req_id)) is not None:
                waiter.waiting_on.discard(save.chunk_hash)
                self._replan(waiter, save.chunk_hash, 0)
        state = self.requests.get(save.req_id)
        if state is not None:
            self._replan(state, save.chunk_hash, save.needs_room, spent=not save.load_failed)

    def load_failed(self, failed: list[str], resting: list[RestingSave]) -> None:
        """A load failed on ``failed``: whoever computes those chunks next saves them again. The saves planned while
        it was unsettled were computed over KV that did not arrive on some worker: every worker drops them (its own
        failure, or the verdict of ``settled_loads``), unwritten. They are settled now, as saves that did not land
        (claims released, planned again from the recompute), so the recompute saves them instead of deduplicating
        against them; the workers' reports of those drops (``load_failed``) are then ignored."""
        for h in failed:
            self.claims.release(h)
        for save in resting:
            if not save.settled:
                save.settled = True
                self.settled(SaveOutcome(save.req_id, save.chunk_hash, landed=False, load_failed=True))

    def _replan(self, state: RequestState, chunk_hash: str, needs_room: int, spent: bool = True) -> None:
        """Plan a save of one of the request's chunks again, now or (``needs_room``) once the queue has room;
        ``spent``: it counts as one of the chunk's attempts (a put that failed)."""
        if chunk_hash in state.hashes:
            chunk = state.hashes.index(chunk_hash)
        elif chunk_hash == state.tail_save:
            chunk = TAIL
        else:
            return
        if needs_room or not spent:
            # Not a failed save (no room, or computed over a failed load: the recompute saves it): its attempt is
            # given back. Under async scheduling the room a report brings was taken a step before the saves already
            # planned for the next step, so a save planned from it can find the queue full again; spending attempts
            # on that gave chunks up for good (seen: 3 of 3 spent).
            state.save_attempts[chunk] = max(0, state.save_attempts[chunk] - 1)
        if needs_room:
            state.awaiting_room[chunk] = max(needs_room, state.awaiting_room.get(chunk, 0))
            self._awaiting_room.setdefault(state.req_id)
        else:
            _plan_again(state, chunk)

    def room_freed(self, room: int) -> None:
        """Plan again, oldest first, the saves dropped for want of queue room that the room now holds.

        Retrying them every step would spend their few attempts within
        milliseconds, long before a put drains the queue; they wait for a
        report whose room covers them instead (the room is a snapshot taken
        after every outcome it travels with, so none waits for a freeing that
        has already happened), and only as many as it holds are planned.
        """
        for req_id in list(self._awaiting_room):
            state = self.requests.get(req_id)
            for chunk, needed in list(state.awaiting_room.items()) if state is not None else []:
                if needed > room:
                    return
                room -= needed
                del state.awaiting_room[chunk]
                _plan_again(state, chunk)
            del self._awaiting_room[req_id]

    # ---- end ------------------------------------------------------------------------
    def request_finished(self, state: RequestState | None, req_id: str, may_save: bool) -> bool:
        """It no longer waits for room or for other requests' saves; True when its finishing tail is planned
        (vLLM must hold its blocks until it is gathered). ``may_save``: its keys can be made (see SchedulerHalf)."""
        self._awaiting_room.pop(req_id, None)
        for chunk_hash in state.waiting_on if state is not None else ():
            waiters = self._waiters.get(chunk_hash)
            if waiters is not None:
                waiters.discard(req_id)
                if not waiters:
                    del self._waiters[chunk_hash]
        return state is not None and may_save and self._plan_finish(state)

    def forget_store(self) -> None:
        """Forget which chunks this instance saved: the next request saves what it computes, as a fresh one would."""
        self.claims = SaveClaims()

    def held(self) -> dict[str, object]:
        """What is held between steps (see SchedulerHalf.state)."""
        return {"awaiting_room": list(self._awaiting_room), "waiters": list(self._waiters),
                "finishing": [s.req_id for s in self._finishing]}


def _plan_again(state: RequestState, chunk: int) -> None:
    """Still holding the chunk's blocks: plan its save again next step (bounded by MAX_SAVE_ATTEMPTS)."""
    if chunk == TAIL:
        state.tail_planned = False
    else:
        state.next_save = min(state.next_save, chunk)


__all__ = ["MAX_SAVE_ATTEMPTS", "SavePlanner"]
