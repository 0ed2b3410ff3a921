"""pytest fixtures for a real Mooncake pool on loopback (start/stop code: storage.testing.mooncake_server).

The session pool (a master and two nodes of 256 MiB) is shared by every test
that only reads and writes; ``mooncake_url`` hands each test its own key prefix
on it, so tests never see each other's keys. Each pytest-xdist worker is a
session of its own, with its own pool on its own free ports. Tests that kill, freeze or fill a
pool start their own with :func:`short_lived_mooncake_pool`.

These tests skip, with the reason, only where the Mooncake client cannot be
imported (no wheel for the platform, or Debian's libibverbs1 missing). CI does
not skip them: ``make install`` installs the ``mooncake`` extra and ``make
test`` installs libibverbs1.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from storage.testing.mooncake_server import MooncakePool, start_mooncake_pool

MiB = 1 << 20


def mooncake_unavailable() -> str | None:
    """Why the Mooncake client cannot be used here, or None when it can."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (
            f"the Mooncake client does not import ({exc}): pip install 'vllm-kvcodec[mooncake]' "
            "and apt-get install libibverbs1 (make install && make test do both)"
        )
    return None


def require_mooncake() -> None:
    reason = mooncake_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def mooncake_pool() -> Iterator[MooncakePool]:
    """One master and two 256 MiB nodes for the whole session."""
    require_mooncake()
    pool = start_mooncake_pool(nodes=2, segment_bytes=256 * MiB)
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def mooncake_url(mooncake_pool: MooncakePool) -> str:
    """The session pool's URL with a key prefix of this test's own."""
    return mooncake_pool.url(prefix=f"test-{uuid.uuid4().hex[:12]}/", buffer="64MiB")


@contextmanager
def short_lived_mooncake_pool(
    nodes: int = 2, segment_bytes: int = 64 * MiB, master_args: Sequence[str] = ()
) -> Iterator[MooncakePool]:
    """A separate pool a test may fill, kill or freeze; always stopped afterwards."""
    require_mooncake()
    pool = start_mooncake_pool(nodes=nodes, segment_bytes=segment_bytes, master_args=master_args)
    try:
        yield pool
    finally:
        pool.stop()
