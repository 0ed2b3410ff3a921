"""Ports for the servers tests and benchmarks start, safe on a machine other test runs share."""

from __future__ import annotations

import socket


def reserved_port() -> int:
    """A port that no other ``bind(("", 0))`` on this host is handed for about a minute.

    A port that was merely bound and closed can be handed to the next process
    that asks the kernel for one, before the server it was picked for binds it.
    This one is left in TIME_WAIT by a connection closed from its side: other
    pickers skip it, while a server that binds with SO_REUSEADDR (vllm serve,
    redis-server) can take it. (A CI failure once blamed on such a race was
    vLLM's shared PROMETHEUS_MULTIPROC_DIR; see server_process._start.)
    """
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # closed first: the TIME_WAIT is on this port's side
            client.recv(1)
    return port
