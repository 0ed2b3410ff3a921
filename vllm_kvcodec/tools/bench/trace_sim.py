"""The whole trace by simulation: a fleet's local prefix caches, the shared store, the router, and what it costs.

Deterministic and sequential: requests are taken in arrival order, each
routed, looked up, served and its KV cached or stored before the next one
(what a replay does when every request is done before the next arrives).
The rules are the engine's and the connector's, so that given a replay's
requests, capacities and routing it predicts each request's split exactly:

- **Prompts** are vLLM's client's (:func:`trace_file.pieces`); a block of
  ``block_tokens`` is known by its tokens and everything before it (a chain,
  as vLLM's block hashes).
- **Local cache** (vLLM's prefix cache): LRU on whole blocks, ``local_tokens``
  of capacity per worker (0: no prefix caching). A hit is the longest run of
  cached blocks, never the block holding the prompt's last token. A finished
  request's full blocks (prompt and answer) are freed last-block-first, as
  vLLM frees them, so its first blocks are evicted last.
- **Store** (the connector, with ``block_hits``): objects are full chunks of
  ``chunk_tokens`` (prompt and answer, as they fill), the prompt's tail (whole
  blocks past its last full chunk up to the one holding its last token, when
  that chunk is not full) and the finishing tail (the same past prompt and
  answer). Every object also names each of its whole-block prefixes (block
  refs). A lookup takes the leading run of stored chunks, then the longest
  ref after it whose object is still there; the connector loads what that hit
  has beyond the local one. LRU on objects, ``store_bytes`` (0: unbounded),
  each object at the codec's measured ratio. Objects are saved from the
  first chunk the store did not hold.
- **Near tier** (``near_bytes`` per worker): objects this worker saved or
  read, LRU; a lookup sees near and far, a read from near costs no far bytes.
- **Routing**: ``round_robin`` (arrival order), ``longest_prefix`` (among the
  workers whose queue of prefill work is within ``balance_s`` of the
  shortest, the one whose local cache holds the longest prefix; ties to the
  shorter queue, then to the one given fewer requests, then the lower index:
  without the guard every request sharing the trace's first block would
  go to one worker), or a given worker per request.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_kvcodec.tools.bench.trace_file import TraceRequest, ceiling_tokens, pieces
from vllm_kvcodec.tools.bench.trace_model import CostModel

POLICIES = ("round_robin", "longest_prefix")


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """The fleet the trace is replayed on."""

    workers: int = 16
    tokens_per_id: int = 512
    block_tokens: int = 16
    chunk_tokens: int = 256
    local_tokens: int = 0  # per worker; 0: no local prefix cache
    store_bytes: int = 0  # 0: unbounded
    connector: bool = True
    near_bytes: int = 0  # per worker; 0: no near tier
    policy: str = "round_robin"
    balance_s: float = 1.0  # longest_prefix: only workers whose queue is this close to the shortest one

    def check(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.block_tokens < 1 or self.chunk_tokens % self.block_tokens:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of block_tokens "
                             f"({self.block_tokens})")
        if min(self.local_tokens, self.store_bytes, self.near_bytes) < 0:
            raise ValueError("capacities must be >= 0")


@dataclasses.dataclass
class Split:
    """One request's prompt tokens by where they came from, and what its load moved."""

    index: int
    worker: int
    prompt: int
    local: int
    store: int
    computed: int
    far_bytes: int = 0
    near_bytes: int = 0
    ttft_s: float = 0.0  # modelled: the wait for its worker, then its load and prefill


def block_keys(request: TraceRequest, tokens_per_id: int, block: int) -> tuple[list[int], int]:
    """The chain key of each whole block of the prompt, and the prompt's length in tokens.

    A block's key hashes its predecessor's key and the pieces (id, size,
    offset, length) it is cut from, so equal keys mean equal tokens from the
    prompt's start.
    """
    keys: list[int] = []
    prev, fill, segments, length = 0, 0, [], 0
    for h, size in pieces(request, tokens_per_id):
        length += size
        off = 0
        if fill == 0:  # whole blocks inside the piece: one segment each
            while size - off >= block:
                prev = hash((prev, (h, size, off, block)))
                keys.append(prev)
                off += block
        while off < size:
            take = min(block - fill, size - off)
            segments.append((h, size, off, take))
            off, fill = off + take, fill + take
            if fill == block:
                prev = hash((prev, *segments))
                keys.append(prev)
                fill, segments = 0, []
    return keys, length


class _Lru:
    """Keys in least-recently-used order, with sizes, under a capacity (0: unbounded)."""

    __slots__ = ("items", "capacity", "size", "evictions")

    def __init__(self, capacity: int) -> None:
        self.items: OrderedDict[int, int] = OrderedDict()
        self.capacity, self.size, self.evictions = capacity, 0, 0

    def __contains__(self, key: int) -> bool:
        return key in self.items

    def touch(self, key: int) -> None:
        self.items.move_to_end(key)

    def put(self, key: int, nbytes: int = 1) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.size -= old
        if self.capacity and nbytes > self.capacity:
            return
        self.items[key] = nbytes
        self.size += nbytes
        while self.capacity and self.size > self.capacity:
            _, n = self.items.popitem(last=False)
            self.size -= n
            self.evictions += 1


class _BlockLru:
    """Cached blocks in least-recently-used order, at most ``capacity`` of them."""

    __slots__ = ("items", "capacity")

    def __init__(self, capacity: int) -> None:
        self.items: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def put_all(self, keys: list[int]) -> None:
        items = self.items
        for k in keys:
            items.pop(k, None)
            items[k] = None
        while len(items) > self.capacity:
            items.popitem(last=False)


class _Request:
    """One request's blocks: the prompt's (shared keys) and the answer's (keys no other request has)."""

    __slots__ = ("index", "keys", "prompt", "total", "max_hit")

    def __init__(self, r: TraceRequest, fleet: FleetSpec, output: int) -> None:
        self.index = r.index
        self.keys, self.prompt = block_keys(r, fleet.tokens_per_id, fleet.block_tokens)
        self.total = self.prompt + output
        self.max_hit = (self.prompt - 1) // fleet.block_tokens  # never the block of the last prompt token

    def key(self, block: int) -> int:
        return self.keys[block] if block < len(self.keys) else hash(("answer", self.index, block))

    def key_range(self, first: int, n: int) -> list[int]:
        """The keys of blocks ``[first, first + n)``, the answer's past the prompt's."""
        out = self.keys[first : first + n]
        return out if len(out) == n else out + [self.key(b) for b in range(first + len(out), first + n)]


class Fleet:
    """The state the requests pass through: local caches, the shared store, near tiers, the router."""

    def __init__(self, fleet: FleetSpec, cost: CostModel) -> None:
        fleet.check()
        self.spec, self.cost = fleet, cost
        self.cb = fleet.chunk_tokens // fleet.block_tokens
        local_blocks = fleet.local_tokens // fleet.block_tokens
        self.local = [_BlockLru(local_blocks) if local_blocks else None for _ in range(fleet.workers)]
        self.store = _Lru(fleet.store_bytes)
        self.refs: dict[int, int] = {}  # a block's chain key -> the object that last named it
        self.near = [_Lru(fleet.near_bytes) if fleet.near_bytes else None for _ in range(fleet.workers)]
        self.assigned = [0] * fleet.workers
        self.next_rr = 0
        self.stored_bytes = self.stored_raw = 0

    # ---- routing ------------------------------------------------------------------------
    def route(self, req: _Request, given: int | None, waits: np.ndarray) -> int:
        if given is not None:
            return given
        if self.spec.policy == "round_robin":
            w, self.next_rr = self.next_rr, (self.next_rr + 1) % self.spec.workers
            return w
        shortest = float(waits.min())
        candidates = [w for w in range(self.spec.workers) if waits[w] <= shortest + self.spec.balance_s]
        return min(candidates, key=lambda w: (-self.local_hit(w, req), waits[w], self.assigned[w], w))

    # ---- the local prefix cache ---------------------------------------------------------
    def local_hit(self, w: int, req: _Request) -> int:
        cache = self.local[w]
        if cache is None:
            return 0
        # What is cached is closed under prefixes: a block's predecessors are put after it, every time it is
        # put (cache_blocks), so LRU evicts a block before them. So the run's end can be found by bisection.
        items, keys = cache.items, req.keys
        lo, hi = 0, req.max_hit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in items:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def cache_blocks(self, w: int, req: _Request) -> None:
        """The finished request's full blocks, freed last block first (so its first blocks are evicted last)."""
        cache = self.local[w]
        if cache is None:
            return
        keys = req.key_range(0, (req.total - 1) // self.spec.block_tokens)  # the last token has no KV
        keys.reverse()
        cache.put_all(keys)

    # ---- the store ------------------------------------------------------------------------
    def present(self, w: int, key: int) -> bool:
        near = self.near[w]
        return key in self.store or (near is not None and key in near)

    def store_hit(self, w: int, req: _Request) -> tuple[int, int, int | None]:
        """(whole chunks, hit end in blocks, the object ending it past those chunks or None)."""
        cb, chunks = self.cb, 0
        while (chunks + 1) * cb <= req.max_hit and self.present(w, req.keys[(chunks + 1) * cb - 1]):
            chunks += 1
        first = chunks * cb
        for j in range(min(req.max_hit - first, cb - 1), 0, -1):
            obj = self.refs.get(req.keys[first + j - 1])
            if obj is not None and self.present(w, obj):
                return chunks, first + j, obj
        return chunks, first, None

    def read(self, w: int, key: int) -> tuple[int, int]:
        """Read one whole object for a load (a ref's object may hold more blocks than the hit): (far, near) bytes."""
        near = self.near[w]
        if near is not None and key in near:
            near.touch(key)
            return 0, near.items[key]
        nbytes = self.store.items[key]
        self.store.touch(key)
        if near is not None:
            near.put(key, nbytes)
        return nbytes, 0

    def save(self, w: int, req: _Request, first_block: int, nblocks: int) -> None:
        """Store one object (a chunk or a tail) and its block refs."""
        blocks = req.key_range(first_block, nblocks)
        key = blocks[-1]
        nbytes = self.cost.object_bytes(nblocks * self.spec.block_tokens)
        if key not in self.store:
            self.stored_bytes += nbytes
            self.stored_raw += nblocks * self.spec.block_tokens * self.cost.model.kv_bytes_per_token
        self.store.put(key, nbytes)
        near = self.near[w]
        if near is not None:
            near.put(key, nbytes)
        self.refs.update(dict.fromkeys(blocks, key))

    def save_request(self, w: int, req: _Request, hit_chunks: int, hit_end: int) -> None:
        """What the connector stores of a served request: chunks from the first the store lacked, then tails."""
        cb, bt = self.cb, self.spec.block_tokens
        for c in range(hit_chunks, (req.total - 1) // self.spec.chunk_tokens):  # the last token has no KV
            self.save(w, req, c * cb, cb)
        index, blocks = divmod(req.max_hit, cb)  # the prompt's tail
        prompt_tail = None
        if blocks and (index + 1) * self.spec.chunk_tokens > req.prompt and hit_end < req.max_hit:
            self.save(w, req, index * cb, blocks)
            prompt_tail = (index, blocks)
        index, blocks = divmod((req.total - 1) // bt, cb)  # the finishing tail
        if blocks and (index, blocks) != prompt_tail and not (index * cb + blocks <= hit_end):
            self.save(w, req, index * cb, blocks)


class WorkerQueues:
    """Each worker runs its requests' prefills one after another, in arrival order; a request waits its turn."""

    def __init__(self, workers: int) -> None:
        self.busy = np.zeros(workers)  # when each worker is free

    def waits(self, arrival: float) -> np.ndarray:
        return np.maximum(self.busy - arrival, 0.0)

    def serve(self, worker: int, arrival: float, service: float) -> float:
        """Book the request; seconds from its arrival until its prefill is done."""
        self.busy[worker] = max(arrival, self.busy[worker]) + service
        return float(self.busy[worker] - arrival)


def queue_ttft(arrivals: Sequence[float], workers: Sequence[int], services: Sequence[float], n_workers: int,
               overhead_s: float = 0.0) -> np.ndarray:
    """The modelled TTFT of requests given in arrival order with their workers and service seconds."""
    queues = WorkerQueues(n_workers)
    return np.array([queues.serve(w, a, s) + overhead_s for a, w, s in zip(arrivals, workers, services)])


def simulate(requests: Sequence[TraceRequest], fleet: FleetSpec, cost: CostModel,
             routing: Sequence[int] | None = None, max_output: int | None = None,
             time_scale: float = 1.0, per_request: bool = False) -> dict[str, Any]:
    """Every request through the fleet; shares of all prompt tokens, GPU-seconds, modelled TTFT.

    ``routing`` gives each request's worker (a replay's), ``max_output`` caps
    answers as a replay did, ``time_scale`` multiplies the trace's arrival
    times (queueing only).
    """
    started = time.perf_counter()
    state = Fleet(fleet, cost)
    splits: list[Split] = []
    queues = WorkerQueues(fleet.workers)
    ttft = np.zeros(len(requests))
    prefill_full = prefill_done = 0.0
    bt = fleet.block_tokens
    for i, r in enumerate(requests):
        output = min(r.output_length, max_output) if max_output else r.output_length
        req = _Request(r, fleet, output)
        arrival = r.timestamp_ms / 1000.0 * time_scale
        w = state.route(req, routing[i] if routing is not None else None, queues.waits(arrival))
        state.assigned[w] += 1
        local = state.local_hit(w, req)  # its blocks move to the LRU's end with the rest in cache_blocks
        far = near = 0
        store_end = local
        if fleet.connector:
            chunks, end, tail_obj = state.store_hit(w, req)
            if end > local:
                store_end = end
                for c in range(local // state.cb, chunks):
                    f, n = state.read(w, req.keys[(c + 1) * state.cb - 1])
                    far, near = far + f, near + n
                if tail_obj is not None:
                    f, n = state.read(w, tail_obj)
                    far, near = far + f, near + n
        split = Split(r.index, w, req.prompt, local * bt, (store_end - local) * bt,
                      req.prompt - store_end * bt, far, near)
        splits.append(split)
        if fleet.connector:
            state.save_request(w, req, chunks, end)
        state.cache_blocks(w, req)
        cached = split.local + split.store
        full_s = cost.model.prefill_s(req.prompt, 0)
        done_s = cost.model.prefill_s(split.computed, cached)
        load_s = cost.load_s(far, near, split.store * cost.model.kv_bytes_per_token) if split.store else 0.0
        ttft[i] = split.ttft_s = queues.serve(w, arrival, cost.request_s(done_s, load_s)) + cost.overhead_s
        prefill_full += full_s
        prefill_done += done_s
    return _result(requests, fleet, cost, state, splits, ttft, prefill_full, prefill_done,
                   time.perf_counter() - started, per_request)


def _result(requests: Sequence[TraceRequest], fleet: FleetSpec, cost: CostModel, state: Fleet, splits: list[Split],
            ttft: np.ndarray, prefill_full: float, prefill_done: float, seconds: float,
            per_request: bool) -> dict[str, Any]:
    prompt = sum(s.prompt for s in splits)
    local, store = sum(s.local for s in splits), sum(s.store for s in splits)
    ceiling = sum(ceiling_tokens(requests, fleet.tokens_per_id))
    out: dict[str, Any] = {
        "benchmark": "trace-simulate",
        "fleet": dataclasses.asdict(fleet), "cost": cost.describe(),
        "requests": len(splits), "prompt_tokens": prompt,
        "shares": {"local": local / prompt, "store": store / prompt, "computed": 1 - (local + store) / prompt},
        "ceiling_share": ceiling / prompt,
        "prefill_gpu_s": {k: v * cost.model.gpus for k, v in (  # replica-seconds times the replica's GPUs
            ("without_cache", prefill_full), ("with", prefill_done), ("saved", prefill_full - prefill_done))},
        "ttft_s": {"p50": float(np.percentile(ttft, 50)), "p90": float(np.percentile(ttft, 90)),
                   "p99": float(np.percentile(ttft, 99)), "mean": float(ttft.mean())},
        "ttft_histogram": _histogram(ttft),
        "store": {"objects": len(state.store.items), "bytes": state.store.size, "evictions": state.store.evictions,
                  "stored_bytes": state.stored_bytes, "stored_raw_bytes": state.stored_raw,
                  "far_bytes_read": sum(s.far_bytes for s in splits),
                  "near_bytes_read": sum(s.near_bytes for s in splits)},
        "seconds": seconds,
    }
    if per_request:
        out["per_request"] = [dataclasses.asdict(s) for s in splits]
    return out


#: The modelled TTFT histogram's bins: log-spaced from 1 ms to its largest value (``top_s``).
HISTOGRAM_BINS = 40


def _histogram(values: np.ndarray) -> dict[str, Any]:
    """Counts on log-spaced bins (``histogram_edges``): the modelled TTFT distribution."""
    top = max(float(values.max()), 2e-3)
    counts, _ = np.histogram(np.clip(values, 1e-3, None), bins=histogram_edges(top))
    return {"top_s": top, "counts": counts.tolist()}


def histogram_edges(top_s: float) -> list[float]:
    return np.logspace(-3, np.log10(top_s), HISTOGRAM_BINS + 1).tolist()
