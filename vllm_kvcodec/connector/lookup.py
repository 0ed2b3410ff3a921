"""Lookup: which of a request's chunks (and, with ``block_hits``, how many blocks after them) the store holds.

Why its own room: in a fleet the store is a network hop away, and vLLM's
scheduler loop stops for every call the connector makes. A lookup made
inline (``lookup: sync``) costs every running request one store round trip
per arriving request: 32 arrivals at 10 ms RTT held one ``schedule()`` for
330 ms. Asynchronously (``lookup: async``, vLLM's "try again" contract, PR
23620; the shape of vLLM's own ``kv_offload/tiering/async_lookup.py``):

- the first call for a request records its question and answers ``None``:
  vLLM leaves the request waiting and asks again next step;
- at the end of the step (``build_connector_meta``) every question of the
  step goes to one background thread as one batch, answered with one
  ``exists_many`` over all their chunk keys (each distinct key once), then
  one read of the block refs (:mod:`~vllm_kvcodec.keys.block_refs`) of the
  whole-block prefixes the chunk hits make possible, and one check that the
  objects the longest of them name are stored;
- requests asking the same question (same chunks, same tail tokens) share
  one probe, also across steps while it is in flight;
- a batch that finds the thread's queue full, and a probe the store has not
  answered within ``lookup_timeout_s``, are answered as misses (counted): a
  store that hangs costs recomputes, never a stuck request;
- a request that ends before its answer leaves nothing behind: its
  reference is dropped, and an answer nobody waits for is discarded; the
  thread does not send a question nobody waits for any more, nor one past
  its deadline (both counted): under overload the store is not handed work
  whose answer would only be thrown away.

On a store that answers within a fraction of a step, making every new
request wait a step costs more than the round trip it saves (a saving
server on loopback Redis lost 6-9% of its throughput so). ``lookup: auto``
(:class:`Budget`) therefore measures what a lookup costs the store and
answers *within the step* while that fits a per-step budget: a new
question goes to the thread at once and the call waits for its answer, at
most what is left of the step's budget; once the budget is spent, later
questions of the step wait for the end-of-step batch. Past the budget
(a slow link, a store that hangs) nothing waits, and once lookups are
cheap again it waits again. The thread answers either way, so a store that
hangs costs the scheduler at most one budget, never a stalled step.

The synchronous mode answers the same questions with the same function
(:func:`answer_questions`), inline, one request at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from vllm_kvcodec.codecs.precision import LOSSLESS
from vllm_kvcodec.keys.block_refs import Ref
from vllm_kvcodec.connector.lookup_budget import LookupBudget
from vllm_kvcodec.keys.identity import PromptIdentity
from vllm_kvcodec.keys.chain import Namespace, tail_hash
from vllm_kvcodec.stats import ConnectorStats

logger = logging.getLogger("vllm_kvcodec")

#: Per chunk key of a precision's namespace, whether the store holds all of it; None when the store did not answer.
Stored = Callable[[list[str], str], "list[bool] | None"]
#: Per block-prefix hash of a precision's namespace, the ref found there if the object it names is stored; None when
#: the store did not answer.
Resolve = Callable[[list[str], str], "list[Ref | None] | None"]


@dataclasses.dataclass(frozen=True)
class Tail:
    """Whole blocks after the hit chunks: ``tokens`` (fewer than a chunk) from the start of chunk ``index``, the
    first tokens of the object ``chunk_hash``, which holds ``object_tokens`` (a prompt's tail, or a chunk)."""

    index: int
    chunk_hash: str
    tokens: int
    object_tokens: int = 0  # 0: exactly ``tokens``

    @property
    def stored_tokens(self) -> int:
        return self.object_tokens or self.tokens


@dataclasses.dataclass(frozen=True)
class Answer:
    """How many leading chunks the store holds, and the longest stored tail right after them.

    ``how``: ``store`` (the store answered), ``unanswered`` (it could
    not, and said so: a miss counted by the caller of ``exists_many``),
    ``timeout`` or ``queue_full`` (an asynchronous probe given up on: a
    miss).
    """

    hit: int
    tail: Tail | None = None
    how: str = "store"
    next_stored: bool = False  # the question's ``next_chunk`` is stored too, right after every hit chunk


MISS = Answer(0)
UNANSWERED = Answer(0, how="unanswered")
TIMED_OUT = Answer(0, how="timeout")
#: Counters of the requests answered with a miss because their probe was given up on.
_GIVEN_UP = {"timeout": "lookup_timeouts", "queue_full": "lookups_queue_full"}


@dataclasses.dataclass(frozen=True)
class Question:
    """One request's question: its loadable chunks, and (``block_hits``) its block-prefix candidates after a hit."""

    chunk_hashes: Sequence[str]
    tails: Callable[[int], list[Tail]] | None = None  # hit (in chunks) -> candidates there, longest first
    #: The chunk after the loadable ones, when it is full in the prompt (it holds the prompt's last token, so it is
    #: computed, never loaded): asked with them, so a request does not save again what the store already holds.
    next_chunk: str | None = None
    precision: str = LOSSLESS  # the namespace its keys are in (see connector/precisions.py)


def tail_candidates(namespace: Namespace, tokens: Sequence[int], identity: PromptIdentity, hashes: Sequence[str],
                    chunk: int, align: int) -> list[Tail]:
    """Every tail after the full chunks ``hashes`` a prompt of ``tokens`` could load, longest first.

    Whole blocks (``align`` tokens), never the last token's (vLLM computes
    it to sample the next): at most ``chunk / align`` of them.
    """
    start = len(hashes) * chunk
    longest = min(chunk - 1, (len(tokens) - 1) // align * align - start) // align * align
    return [Tail(len(hashes), tail_hash(namespace, tokens, list(hashes), t, identity), t)
            for t in range(longest, 0, -align)]


def answer_questions(questions: Sequence[Question], stored: Stored, resolve: Resolve,
                     expired: Callable[[], bool] | None = None) -> list[Answer]:
    """Every question, with one store call over all their chunks and one (plus its check) over the block
    prefixes their hits allow: per namespace the questions are keyed in (one, unless requests demand another
    precision than the engine's).

    The prefixes can only be asked once the chunk hits are known (they hang
    off the chain right after them), hence two calls, not one; when
    ``expired`` says nobody waits for the answers any more by the time the
    first returns, the second is not sent (the answers: timeouts).
    """
    by_precision: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_precision.setdefault(q.precision, []).append(i)
    answers: list[Answer] = [MISS] * len(questions)
    for precision, which in by_precision.items():
        got = _answer_in([questions[i] for i in which], lambda keys: stored(keys, precision),
                         lambda keys: resolve(keys, precision), expired)
        for i, answer in zip(which, got):
            answers[i] = answer
    return answers


def _answer_in(questions: Sequence[Question], stored: Callable[[list[str]], "list[bool] | None"],
               resolve: Callable[[list[str]], "list[Ref | None] | None"],
               expired: Callable[[], bool] | None) -> list[Answer]:
    """:func:`answer_questions` for questions keyed in one namespace."""
    chunk_keys = list(dict.fromkeys(h for q in questions for h in [*q.chunk_hashes, q.next_chunk] if h is not None))
    found = stored(chunk_keys) if chunk_keys else []
    if found is None:
        return [UNANSWERED] * len(questions)
    if expired is not None and expired():
        return [TIMED_OUT] * len(questions)
    present = dict(zip(chunk_keys, found))
    hits = [next((c for c, h in enumerate(q.chunk_hashes) if not present[h]), len(q.chunk_hashes)) for q in questions]
    candidates = [q.tails(hit) if q.tails is not None else [] for q, hit in zip(questions, hits)]
    prefix_keys = list(dict.fromkeys(t.chunk_hash for ts in candidates for t in ts))
    refs = dict(zip(prefix_keys, (resolve(prefix_keys) if prefix_keys else None) or [None] * len(prefix_keys)))
    return [Answer(hit, _longest(ts, refs), next_stored=q.next_chunk is not None and hit == len(q.chunk_hashes)
                   and present[q.next_chunk]) for q, hit, ts in zip(questions, hits, candidates)]


def _longest(candidates: list[Tail], refs: dict[str, Ref | None]) -> Tail | None:
    """The longest candidate with a ref, as the object to load and how many of its tokens."""
    for t in candidates:
        if (ref := refs[t.chunk_hash]) is not None and ref.object_tokens >= t.tokens:
            return Tail(t.index, ref.chunk_hash, t.tokens, 0 if ref.object_tokens == t.tokens else ref.object_tokens)
    return None


@dataclasses.dataclass(eq=False)
class _Probe:
    """One question in the air, and the requests waiting for its answer."""

    key: Hashable
    question: Question
    requests: set[str] = dataclasses.field(default_factory=set)
    deadline: float | None = None  # set when submitted
    answer: Answer | None = None
    gone: bool = False  # every request that asked it ended first: the thread does not send it
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # set once the thread dealt with it


#: Empty existence checks the lookup thread times at start (``auto``), before any request asks.
PROBES = 3


@dataclasses.dataclass(frozen=True)
class _Timed:
    """How long one batch (or probe) kept the store busy, and whether it answered: a call refused at once while
    the store is down says nothing of how fast the store answers."""

    seconds: float
    answered: bool


class AsyncLookup:
    """The lookup thread and what the scheduler thread keeps about its questions.

    Only the scheduler thread touches the probes' answers and requests; the
    lookup thread gets batches through a bounded queue and hands answers back
    through another, drained by the scheduler thread (no lock around the
    probes, as in vLLM's ``AsyncLookupManager``). The thread only reads a
    probe's ``gone`` flag and deadline, and sets its ``done`` event.

    ``budget`` (``lookup: auto``): while it says waiting is worth it, a new
    question is submitted at once and the asking call waits for the answer,
    at most what is left of the step's budget (see :mod:`~.lookup_budget`).
    """

    def __init__(self, stored: Stored, resolve: Resolve, stats: ConnectorStats, *, timeout_s: float,
                 max_batches: int, budget: LookupBudget | None = None,
                 probe: Callable[[], object] | None = None) -> None:
        self._stored, self._resolve = stored, resolve
        self.stats = stats
        self.timeout_s = timeout_s
        self.budget = budget
        self._probe_store = probe
        self._probes: dict[Hashable, _Probe] = {}  # sharing key -> probe not yet answered
        self._of_request: dict[str, _Probe] = {}
        self._batch: list[_Probe] = []  # asked this step, submitted at its end
        self._asked = False  # this step created a question
        self._queue: queue.Queue[list[_Probe] | None] = queue.Queue(maxsize=max_batches)
        self._answers: queue.SimpleQueue[tuple[list[tuple[_Probe, Answer]], _Timed | None]] = queue.SimpleQueue()
        self._unanswered = 0  # batches queued or being answered (wait_idle)
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self._warned = False
        if budget is not None and probe is not None:
            self._start()  # measures the store before the first request asks

    # ---- scheduler thread -------------------------------------------------------------
    def ask(self, req_id: str, key: Hashable, question: Question) -> Answer | None:
        """The answer to ``req_id``'s question, or None: asked (or still in the air), ask again next step."""
        self._drain()
        probe = self._of_request.get(req_id)
        first = probe is None
        if probe is None:
            probe = self._probes.get(key)
            new = probe is None
            if new:
                probe = self._probes[key] = _Probe(key, question)
                self._asked = True
            else:
                self.stats.add(lookups_shared=1)
            probe.requests.add(req_id)
            self._of_request[req_id] = probe
            if new and self._wait_left():
                self._submit([probe])  # asked now: its answer may come within this step
            elif new:
                self._batch.append(probe)  # asked with the step's other questions at its end
        if probe.answer is None and probe.deadline is not None:
            if time.monotonic() >= probe.deadline:
                self._settle(probe, TIMED_OUT)
            elif self._wait_left():
                self._wait(probe)
        if probe.answer is None:
            self.stats.add(lookup_retries=1)
            return None
        self.forget(req_id)
        if probe.answer.how in _GIVEN_UP:
            self.stats.add(**{_GIVEN_UP[probe.answer.how]: 1})
        elif first:
            self.stats.add(lookups_answered_in_step=1)
        return probe.answer

    def flush(self, ran: bool = True) -> None:
        """End of a scheduler step (``ran``: it scheduled tokens): this step's new questions go to the lookup thread
        as one batch, and the next step gets a fresh budget."""
        self._drain()
        batch, self._batch = [p for p in self._batch if p.requests], []
        if batch:
            self._submit(batch)
        if self.budget is not None:
            self.budget.step_ended(ran, self._asked)
        self._asked = False

    def forget(self, req_id: str) -> None:
        """``req_id`` no longer waits (answered, finished or aborted): an answer nobody waits for is dropped."""
        probe = self._of_request.pop(req_id, None)
        if probe is None:
            return
        probe.requests.discard(req_id)
        if probe.requests or probe.answer is not None:
            return
        if probe.deadline is None:  # never submitted: ask nobody
            self._batch = [p for p in self._batch if p is not probe]
        else:  # in the air: not sent if the thread has not come to it (a request asking the same asks anew)
            probe.gone = True
        self._drop(probe)

    def in_flight(self) -> bool:
        """Whether a submitted batch has no answer yet."""
        return self._unanswered > 0

    def waiting(self) -> list[str]:
        """Requests whose question has no answer they took yet (tests check none is left)."""
        return list(self._of_request)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted batch is answered, and take the answers (tests, to step deterministically)."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._unanswered == 0, timeout)
        self._drain()
        return done

    def shutdown(self) -> None:
        if self._thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass  # a thread stuck on a hung store: a daemon, it goes with the process
            self._thread.join(timeout=1.0)

    def _wait_left(self) -> float:
        return self.budget.wait_left() if self.budget is not None else 0.0

    def _wait(self, probe: _Probe) -> None:
        """Wait for ``probe``'s answer, at most what is left of the step's budget."""
        started = time.monotonic()
        probe.done.wait(self._wait_left())
        self.budget.waited(time.monotonic() - started)  # type: ignore[union-attr] - only with a budget
        self._drain()

    def _submit(self, batch: list[_Probe]) -> None:
        deadline = time.monotonic() + self.timeout_s
        for probe in batch:
            probe.deadline = deadline
        self._start()
        with self._idle:
            self._unanswered += 1
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            with self._idle:
                self._unanswered -= 1
            for probe in batch:
                self._settle(probe, dataclasses.replace(MISS, how="queue_full"))
            self._warn("the lookup queue is full (the store is slower than requests arrive); computing those prefixes")
            return
        self.stats.add(lookup_batches=1, lookup_batch_requests=sum(len(p.requests) for p in batch))

    def _drain(self) -> None:
        while True:
            try:
                answers, timing = self._answers.get_nowait()
            except queue.Empty:
                return
            if self.budget is not None and timing is not None and timing.answered:
                self.budget.observe(timing.seconds)
            elif self.budget is not None and timing is not None:
                self.budget.unanswered()
            for probe, answer in answers:
                if probe.answer is None:  # not given up on meanwhile (timeout)
                    self._settle(probe, answer)

    def _settle(self, probe: _Probe, answer: Answer) -> None:
        probe.answer = answer
        self._drop(probe)  # requests asking the same from now on ask the store anew
        if answer.how == "timeout":
            self._warn(f"the store did not answer a lookup within lookup_timeout_s {self.timeout_s} s; "
                       "computing those prefixes instead")

    def _drop(self, probe: _Probe) -> None:
        if self._probes.get(probe.key) is probe:
            del self._probes[probe.key]

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("kvcodec: %s", message)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvcodec-lookup", daemon=True)
            self._thread.start()

    # ---- lookup thread ----------------------------------------------------------------
    def _run(self) -> None:
        if self.budget is not None and self._probe_store is not None:
            self._measure()
        while (batch := self._queue.get()) is not None:
            self._answers.put(self._answer(batch))
            for probe in batch:
                probe.done.set()
            with self._idle:
                self._unanswered -= 1
                self._idle.notify_all()

    def _answer(self, batch: list[_Probe]) -> tuple[list[tuple[_Probe, Answer]], _Timed | None]:
        """The batch's answers, and how long the store took to give them (None: nothing was sent).

        A question nobody waits for any more (its requests ended) or past its
        deadline (the scheduler has answered it with a miss, or will) is not
        sent, counted: a store that fell behind is not handed work whose
        answers would be thrown away.
        """
        now = time.monotonic()
        live = [p for p in batch if not p.gone and now < p.deadline]  # type: ignore[operator] - submitted: set
        late = [p for p in batch if not p.gone and p not in live]
        if gone := len(batch) - len(live) - len(late):
            self.stats.add(lookups_skipped_unwanted=gone)
        out = [(p, TIMED_OUT) for p in late]
        if not live:
            if late:
                self.stats.add(lookups_skipped_late=len(late))
            return out, None
        deadline = min(p.deadline for p in live)  # type: ignore[type-var]
        if self.budget is not None:
            self.budget.answering(now)
        try:
            answers = answer_questions([p.question for p in live], self._stored, self._resolve,
                                       expired=lambda: time.monotonic() >= deadline)
        except Exception:  # noqa: BLE001 - never let a lookup kill the thread: a miss
            logger.exception("kvcodec: lookup failed; computing those prefixes")
            self.stats.add(lookup_failures=1)
            answers = [UNANSWERED] * len(live)
        finally:
            if self.budget is not None:
                self.budget.answering(None)
        if skipped := len(late) + sum(a is TIMED_OUT for a in answers):
            self.stats.add(lookups_skipped_late=skipped)
        answered = any(a is not UNANSWERED for a in answers)
        return out + list(zip(live, answers)), _Timed(time.monotonic() - now, answered)

    def _measure(self) -> None:
        """What a lookup costs before any request asks: a few existence checks of a key no chunk has."""
        for _ in range(PROBES):
            started = time.monotonic()
            self.budget.answering(started)  # type: ignore[union-attr] - only with a budget
            try:
                self._probe_store()  # type: ignore[misc] - only with a probe
            except Exception as exc:  # noqa: BLE001 - a store not up yet: measured by the first lookups instead
                logger.info("kvcodec: probing the store's round trip failed (%s); lookups stay on the thread until "
                            "the store answers", exc)
                self._answers.put(([], _Timed(time.monotonic() - started, answered=False)))
                return
            finally:
                self.budget.answering(None)  # type: ignore[union-attr]
            self._answers.put(([], _Timed(time.monotonic() - started, answered=True)))
