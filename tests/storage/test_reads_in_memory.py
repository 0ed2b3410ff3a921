"""Which stores read by copying memory on this host: the fetcher reads on no more threads than it decodes on there."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import open_store, reads_in_memory
from storage.file_store import filesystem_type
from storage.outage import OutageGuard
from vllm_kvcodec.load.cores import NETWORK_FETCH_THREADS, LoadThreads, load_threads, usable_cores

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
server:/export /mnt/kv nfs4 rw,vers=4.2 0 0
/dev/vdb /mnt/kv/local ext4 rw 0 0
//nas/share /mnt/my\\040share cifs rw 0 0
"""


@pytest.mark.parametrize("path,kind", [
    ("/", "ext4"), ("/work/store", "ext4"), ("/mnt/kv", "nfs4"), ("/mnt/kv/a/b", "nfs4"),
    ("/mnt/kv/local/x", "ext4"), ("/mnt/kvx", "ext4"), ("/mnt/my share/s", "cifs"),
])
def test_a_path_takes_the_type_of_its_longest_mount_point(path: str, kind: str) -> None:
    assert filesystem_type(path, MOUNTS) == kind


def test_local_and_memory_stores_read_in_memory_and_network_ones_do_not(tmp_path: Path) -> None:
    assert open_store(f"file://{tmp_path}/s").reads_in_memory  # tmp_path is on a local file system here
    assert open_store("memory://").reads_in_memory
    assert open_store(f"file://{tmp_path}/s", read_only=True).reads_in_memory  # the wrapper answers for it
    assert not open_store(f"link+file://{tmp_path}/s?gbps=10").reads_in_memory  # an emulated link waits
    assert not open_store("redis://127.0.0.1:1/0").reads_in_memory  # a network client; nothing is asked of it
    guard = OutageGuard(f"file://{tmp_path}/s", open_store)
    guard.probe()
    assert guard.reads_in_memory


@pytest.mark.parametrize("url", ["file://{tmp}/s", "file://{tmp}/s?max_bytes=1GiB", "memory://", "link+file://{tmp}/s?gbps=10",
                                 "faults+file://{tmp}/s?seed=1", "redis://127.0.0.1:1/0"])
def test_the_url_alone_tells_what_the_open_store_says(tmp_path: Path, url: str) -> None:
    """The connector shapes its keys by it before either half opens the store: both must agree with the store."""
    url = url.format(tmp=tmp_path)
    said = reads_in_memory(url)  # before the store exists: nothing is created or asked
    assert not (tmp_path / "s").exists()
    with open_store(url) as store:
        assert said == store.reads_in_memory


def test_a_file_store_on_a_network_file_system_does_not_read_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import storage.file_store as fs

    monkeypatch.setattr(fs, "on_network_filesystem", lambda path: path.startswith("/mnt/kv"))
    assert not reads_in_memory("file:///mnt/kv/store") and reads_in_memory("file:///var/store")


def test_load_threads_follow_the_engine_and_the_store() -> None:
    import torch

    idle = max(1, usable_cores() - torch.get_num_threads())
    assert load_threads(None, None, on_device=False, reads_in_memory=True) == LoadThreads(idle, idle)
    assert load_threads(None, None, on_device=False, reads_in_memory=False) == LoadThreads(max(idle, NETWORK_FETCH_THREADS), idle)
    assert load_threads(None, None, on_device=True, reads_in_memory=True) == LoadThreads(4, 4)
    assert load_threads(8, None, on_device=True, reads_in_memory=False) == LoadThreads(8, 8)
    assert load_threads(3, 2, on_device=False, reads_in_memory=True) == LoadThreads(3, 2)  # as configured
    assert load_threads(None, 6, on_device=False, reads_in_memory=True) == LoadThreads(6, 6)
    # The prefill may wait for whole loads: every core decodes where the engine leaves none idle.
    whole = usable_cores() if usable_cores() <= torch.get_num_threads() else idle
    assert load_threads(None, None, on_device=False, reads_in_memory=True, whole_loads=True) == LoadThreads(whole, whole)
    assert load_threads(None, None, on_device=True, reads_in_memory=True, whole_loads=True) == LoadThreads(4, 4)
    assert load_threads(None, 1, on_device=False, reads_in_memory=True, whole_loads=True) == LoadThreads(1, 1)
