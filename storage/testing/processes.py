"""A server process a test helper started (redis-server, mooncake_master, a Mooncake node): crash, hang, stop.

Why one place: the failure tests need the same three things of every server,
the way they happen in production. SIGKILL is a crash (the process and its
memory vanish mid-conversation), SIGSTOP a hung host (sockets stay open, nothing
answers), SIGCONT its recovery. Stopping is by the process's own pid, never by
name, so other servers on the machine are left alone.
"""

from __future__ import annotations

import os
import signal
import subprocess


class OwnedProcess:
    """Mixed into a helper that keeps its ``subprocess.Popen`` in ``_proc``; ``stop()`` is idempotent."""

    _proc: subprocess.Popen[bytes] | None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: gone mid-conversation, as in a crash."""
        self._signal(signal.SIGKILL)
        self.stop()

    def freeze(self) -> None:
        """SIGSTOP: keeps its sockets but never answers, as in a hung host."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate(proc, timeout)
        self._stopped()

    def _stopped(self) -> None:
        """What else to clean up once the process is gone (a working directory)."""

    def _signal(self, signum: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signum)


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM (after SIGCONT: a frozen process cannot act on it), then SIGKILL if it lingers."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
