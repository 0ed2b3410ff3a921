"""Start and stop a throwaway local ``redis-server``, for tests and benchmarks.

Why a real server and not a fake: timeouts, pipelining, a server killed
mid-request and TLS are exactly what a fake gets wrong. The server listens on a
free loopback port, keeps nothing on disk (``--save '' --appendonly no``, its
working directory is a temp dir removed on stop), and is stopped by its own pid,
never by name, so it cannot disturb other servers on the machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from storage.testing.ports import reserved_port
from storage.testing.processes import OwnedProcess

START_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


def find_redis_server() -> str | None:
    """Path of the redis-server executable, or None when it is not on PATH."""
    return shutil.which("redis-server")


@dataclass
class RedisServer(OwnedProcess):
    """A running local redis-server; ``stop()`` is idempotent."""

    port: int
    pid: int
    workdir: str
    tls: bool = False
    cluster: bool = False
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _stopped(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis_server(
    extra_args: Sequence[str] = (), *, tls_files: dict[str, str] | None = None, cluster: bool = False
) -> RedisServer:
    """Start redis-server on a free loopback port and wait until it answers.

    ``tls_files`` (keys ``cert``, ``key``, ``ca``) serves TLS only, on that port.
    ``cluster`` makes a one-node Redis Cluster owning every slot: the cluster
    client code path on a single process. A port taken between choosing and
    binding it is retried with another.
    """
    if cluster:
        if tls_files is not None:
            raise ValueError("a TLS cluster is not supported by this helper")
        extra_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *extra_args]
    executable = find_redis_server()
    if executable is None:
        raise RedisServerError("redis-server is not on PATH; install it (apt-get install redis-server)")
    for attempt in range(3):
        try:
            server = _start_once(executable, extra_args, tls_files)
        except RedisServerError:
            if attempt == 2:
                raise
            continue
        if cluster:
            server.cluster = True
            _claim_all_slots(server)
        return server
    raise AssertionError("unreachable")


def _start_once(executable: str, extra_args: Sequence[str], tls_files: dict[str, str] | None) -> RedisServer:
    workdir = tempfile.mkdtemp(prefix="kvcodec-redis-")
    port = reserved_port()  # redis-server binds with SO_REUSEADDR
    args = [executable, *_base_args(port, workdir, tls_files), *extra_args]
    log = open(os.path.join(workdir, "redis.log"), "wb")
    with log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = RedisServer(port=port, pid=proc.pid, workdir=workdir, tls=tls_files is not None, _proc=proc)
    try:
        _wait_until_listening(server, proc)
    except BaseException:
        server.stop()
        raise
    return server


def _base_args(port: int, workdir: str, tls_files: dict[str, str] | None) -> list[str]:
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir, "--daemonize", "no"]
    if tls_files is None:
        return ["--port", str(port), *common]
    tls = ["--tls-cert-file", tls_files["cert"], "--tls-key-file", tls_files["key"]]
    tls += ["--tls-ca-cert-file", tls_files["ca"]]
    return ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no", *tls, *common]


def _wait_until_listening(server: RedisServer, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RedisServerError(f"redis-server exited with {proc.returncode}:\n{_log_tail(server.workdir)}")
        if _answers(server.port, server.tls):
            return
        time.sleep(0.02)
    raise RedisServerError(f"redis-server did not listen on port {server.port} within {START_TIMEOUT_S} s")


def _claim_all_slots(server: RedisServer) -> None:
    """Give the single node every hash slot and wait for the cluster state to turn ok."""
    try:
        _inline_command(server.port, b"CLUSTER ADDSLOTSRANGE 0 16383")
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"cluster_state:ok" not in _inline_command(server.port, b"CLUSTER INFO"):
            if time.monotonic() > deadline:
                raise RedisServerError(f"one-node cluster on port {server.port} did not reach cluster_state:ok")
            time.sleep(0.05)
    except BaseException:
        server.stop()
        raise


def _inline_command(port: int, command: bytes) -> bytes:
    """Send one inline command and return the reply once it ends with CRLF (enough for +OK and short bulk)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
        sock.sendall(command + b"\r\n")
        reply = b""
        while not _reply_complete(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def _reply_complete(reply: bytes) -> bool:
    if not reply.endswith(b"\r\n"):
        return False
    if not reply.startswith(b"$"):
        return True
    header, _, body = reply.partition(b"\r\n")
    return len(body) >= int(header[1:]) + 2


def _answers(port: int, tls: bool) -> bool:
    """PING on a plain port (NOAUTH counts: it is up); on a TLS port a TCP connect is enough (the handshake needs the CA)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if tls:
                return True
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # a password-protected server answers too
    except OSError:
        return False


def _log_tail(workdir: str, limit: int = 2000) -> str:
    try:
        with open(os.path.join(workdir, "redis.log"), "rb") as f:
            return f.read()[-limit:].decode("utf-8", "replace")
    except OSError:
        return "(no log)"

