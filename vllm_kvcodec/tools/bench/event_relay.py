"""A shared store's KV events, fanned out to every worker that reads that store, for a router that subscribes per worker.

vllm-router's ``kv_aware`` keeps one index per event source (one source per
worker) and credits a block to the worker whose stream announced it. A block
announced with an ownership (the connector's store events) is its External
tier, but still credited only to the worker that saved it, although every
worker configured with the same store can load it. The connector cannot
announce on other workers' behalf; who shares a store is deployment
knowledge. This relay applies it: for each worker it publishes that worker's
own events, plus the store events (those with ``ownership``) of every other
worker, on an endpoint of its own, with its own sequence numbers. The router
is then given ``--kv-event-source WORKER=RELAY_ENDPOINT``.

Batches are re-encoded as vLLM encodes them (msgpack ``[ts, events, rank]``,
each event a map tagged by ``type``); nothing else is changed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from storage.testing.ports import reserved_port


class StoreEventRelay:
    """One SUB per worker endpoint in, one PUB per worker out; stopped by ``close()`` (or as a context manager)."""

    def __init__(self, sources: Sequence[str], ownership: str, host: str = "127.0.0.1") -> None:
        self.ownership = ownership
        self._ctx = zmq.Context()
        self._subs, self._pubs, self.endpoints = [], [], []
        for src in sources:
            sub = self._ctx.socket(zmq.SUB)
            sub.connect(src)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._subs.append(sub)
            pub = self._ctx.socket(zmq.PUB)
            endpoint = f"tcp://{host}:{reserved_port()}"
            pub.bind(endpoint)
            self._pubs.append(pub)
            self.endpoints.append(endpoint)
        self._seq = [0] * len(sources)
        self.forwarded = [0] * len(sources)  # events published per output
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)
        self._thread.start()

    def __enter__(self) -> StoreEventRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                source = self._subs.index(sock)
                frames = sock.recv_multipart()
                if len(frames) >= 3:
                    self._fan_out(source, frames[0], frames[-1])

    def _fan_out(self, source: int, topic: bytes, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        ts, events, rest = batch[0], batch[1], batch[2:]
        shared = [e for e in events if isinstance(e, dict) and e.get("ownership") == self.ownership]
        for out, pub in enumerate(self._pubs):
            mine = events if out == source else shared
            if mine:
                self._publish(out, pub, topic, [ts, mine, *rest])

    def _publish(self, out: int, pub: Any, topic: bytes, batch: list[Any]) -> None:
        pub.send_multipart([topic, self._seq[out].to_bytes(8, "big", signed=True), msgspec.msgpack.encode(batch)])
        self._seq[out] += 1
        self.forwarded[out] += len(batch[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in (*self._subs, *self._pubs):
            s.close(linger=0)
        self._ctx.term()
