"""Start and stop a throwaway Mooncake pool on loopback: one ``mooncake_master`` and N memory nodes.

Why real processes: eviction, leases, a master restart and a node leaving are
what the store must survive, and only the real master and nodes do them. The
master runs with its built-in HTTP metadata server; each node is a
``mooncake_client`` process (Mooncake's standalone client) that mounts a memory
segment into the pool, so two nodes are two machines' worth of pool on one
host. Every port is a free loopback port chosen here, logs go to a temp
directory removed on stop, and every process is stopped by its own pid, never
by name, so other pools on the machine are left alone. On Linux each process
is also killed when the thread that started it dies, so a test run that
crashes (Mooncake's client can segfault) leaves no pool behind; start pools
from a thread that outlives them (the main thread, as pytest and the
benchmarks do).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

from storage.testing.processes import OwnedProcess

START_TIMEOUT_S = 20.0
_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


class MooncakeServerError(RuntimeError):
    """The Mooncake binaries are missing or a process did not come up."""


def find_mooncake() -> Path | None:
    """The folder of the pip package's ``mooncake_master`` and ``mooncake_client``, or None when not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / "mooncake_master").is_file() and (folder / "mooncake_client").is_file() else None


@dataclass
class MooncakeProcess(OwnedProcess):
    """One master or node process; ``stop()`` is idempotent."""

    name: str
    args: list[str]
    log: Path
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self._proc is not None, f"{self.name} is not running"
        return self._proc.pid

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
            )

    def exited(self) -> str | None:
        """Why the process is gone (exit code and log tail), or None while it runs."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"{self.name} exited with {self._proc.returncode}:\n{_tail(self.log)}"


@dataclass
class MooncakePool:
    """A running master and its nodes; ``segments`` maps each node to its segment's name in the master."""

    rpc_port: int
    metadata_port: int
    admin_port: int
    workdir: str
    master: MooncakeProcess
    nodes: list[MooncakeProcess] = field(default_factory=list)
    segments: dict[str, str] = field(default_factory=dict)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def url(self, **options: str | int | float) -> str:
        """A ``mooncake://`` URL for this pool; ``options`` add to (or override) the loopback defaults."""
        query = {
            "metadata": f"http://127.0.0.1:{self.metadata_port}/metadata",
            "admin": self.admin,
            "local_host": "127.0.0.1",
            **{k: str(v) for k, v in options.items()},
        }
        return f"mooncake://127.0.0.1:{self.rpc_port}?{urlencode(query, safe=':/')}"

    def admin_get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.admin}{path}", timeout=5) as reply:
            return reply.read().decode()

    def live_segments(self) -> set[str]:
        try:
            return set(self.admin_get("/get_all_segments").split())
        except OSError:
            return set()

    def replica_segments(self, key: str) -> list[str]:
        """The segments holding ``key``'s replicas (empty when the master does not know it)."""
        reply = json.loads(self.admin_get(f"/query_key?key={key}"))
        return [r["transport_endpoint_"] for r in reply.get("data", [])] if reply.get("success") else []

    def restart_master(self) -> None:
        """Kill the master and start a new one on the same ports; returns once every running node re-joined."""
        self.master.kill()
        self.master.start()
        _wait_for(lambda: _admin_answers(self.admin_port), self.master, "master admin server")
        wanted = {self.segments[n.name] for n in self.nodes if n.running}
        _wait_for(lambda: wanted <= self.live_segments(), self.master, "nodes re-joining the new master")

    def stop(self) -> None:
        for proc in [*self.nodes, self.master]:
            proc.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MooncakePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_mooncake_pool(nodes: int = 2, segment_bytes: int = 64 << 20, master_args: Sequence[str] = ()) -> MooncakePool:
    """Start a master and ``nodes`` nodes of ``segment_bytes`` each; wait until every segment is mounted.

    ``master_args`` are extra ``mooncake_master`` flags (e.g. ``--client_ttl=2``).
    A port taken between choosing and binding it is retried with others.
    """
    folder = find_mooncake()
    if folder is None:
        raise MooncakeServerError("mooncake_master is not installed: pip install 'vllm-kvcodec[mooncake]'")
    for attempt in range(3):
        pool = _start_master(folder, master_args)
        try:
            for i in range(nodes):
                _start_node(pool, folder, f"node{i}", segment_bytes)
            return pool
        except MooncakeServerError:
            pool.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_master(folder: Path, extra: Sequence[str]) -> MooncakePool:
    workdir = tempfile.mkdtemp(prefix="kvcodec-mooncake-")
    rpc, metadata, admin = _free_ports(3)
    args = [
        str(folder / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={metadata}", f"--metrics_port={admin}", "--metrics_host=127.0.0.1", *extra,
    ]
    master = MooncakeProcess("master", args, Path(workdir) / "master.log")
    pool = MooncakePool(rpc, metadata, admin, workdir, master)
    master.start()
    try:
        _wait_for(lambda: _admin_answers(admin), master, "master admin server")
    except BaseException:
        pool.stop()
        raise
    return pool


def _start_node(pool: MooncakePool, folder: Path, name: str, segment_bytes: int) -> None:
    (port,) = _free_ports(1)
    args = [
        str(folder / "mooncake_client"), f"--global_segment_size={segment_bytes}", "--host=127.0.0.1",
        f"--port={port}", f"--master_server_address=127.0.0.1:{pool.rpc_port}",
        f"--metadata_server=http://127.0.0.1:{pool.metadata_port}/metadata",
    ]
    node = MooncakeProcess(name, args, Path(pool.workdir) / f"{name}.log")
    before = pool.live_segments()
    pool.nodes.append(node)
    node.start()
    _wait_for(lambda: len(pool.live_segments() - before) == 1, node, f"{name}'s segment")
    (pool.segments[name],) = pool.live_segments() - before


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when its parent thread dies (no-op off Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait_for(ready, proc: MooncakeProcess, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (why := proc.exited()) is not None:
            hint = " (its binaries need Debian's libibverbs1)" if "libibverbs" in why else ""
            raise MooncakeServerError(f"waiting for {what}: {why}{hint}")
        if ready():
            return
        time.sleep(0.05)
    raise MooncakeServerError(f"{what} not ready within {START_TIMEOUT_S} s:\n{_tail(proc.log)}")


def _admin_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_bytes()[-limit:].decode("utf-8", "replace")
    except OSError:
        return "(no log)"
