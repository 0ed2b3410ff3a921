"""Pools start every thread at construction, so a request never pays for starting one."""

from __future__ import annotations

import threading

from vllm_kvcodec.runtime.threads import started_pool


def _named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_every_thread_runs_its_initializer_before_the_pool_is_returned() -> None:
    ran: list[str] = []
    pool = started_pool(3, "kvcodec-test-pool", lambda tag: ran.append(tag), ("init",))
    try:
        assert len(_named("kvcodec-test-pool")) == 3 and ran == ["init"] * 3
        assert pool.submit(lambda: threading.current_thread().name).result().startswith("kvcodec-test-pool")
        assert len(_named("kvcodec-test-pool")) == 3  # no thread started for the task
    finally:
        pool.shutdown(wait=True)
    assert not _named("kvcodec-test-pool")


def test_the_fetcher_and_saver_start_their_threads_when_built(tmp_path) -> None:
    import torch

    from storage import open_store
    from vllm_kvcodec.save.codec_choice import CodecChooser
    from vllm_kvcodec.keys.chain import Namespace, ObjectAddresses
    from vllm_kvcodec.load.fetcher import Fetcher
    from vllm_kvcodec.paged import layout_for
    from vllm_kvcodec.save.saver import Saver
    from vllm_kvcodec.stats import ConnectorStats

    caches = [torch.zeros((4, 2, 16, 64), dtype=torch.bfloat16) for _ in range(2)]
    layout = layout_for("CPU_ATTN", caches[0], block_size=16, head_size=32, num_kv_heads=2)
    ns = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, layout_id="canonical-v1",
                   tp_size=1, chunk_size=16, layers_per_object=1)
    addresses, store, stats = ObjectAddresses(ns, 0, tuple(ns.layer_groups())), open_store("memory://"), ConnectorStats()
    before = {p: len(_named(p)) for p in ("kvcodec-fetch", "kvcodec-decode", "kvcodec-save")}
    fetcher = Fetcher(store, addresses, caches, [layout] * 2, 3, stats, decode_threads=2)
    saver = Saver(store, addresses, CodecChooser("raw"), 2, 1 << 20, stats)
    try:
        started = {p: len(_named(p)) - n for p, n in before.items()}
        assert started == {"kvcodec-fetch": 3, "kvcodec-decode": 2, "kvcodec-save": 2}
    finally:
        fetcher.shutdown()
        saver.shutdown()
