"""Two engines on one store serving a LoRA adapter of one name from two paths never share KV.

vLLM keys its own prefix cache by the adapter's name and path; a shared
store meets every instance of a fleet, and one name may point at other
weights on another instance. Each engine's greedy tokens must equal its own
local-prefix-cache run; the adapter whose weights did compute the stored
chunks still loads them.

Each instance is an engine of its own, not the shared engine reset: vLLM's
LoRA manager keeps an adapter's weights by its int id until it evicts them,
so one engine asked for "a" (id 1) at P2 after P1 would serve P1's weights,
which is not what two instances of a fleet do. That is also why an adapter's
files say nothing of the weights an engine runs: the keys name the files the
workers loaded (connector/lora_keys.py, lora_loads.py), whatever has become of
the files since, and a request whose adapter weights are unknown is not
cached.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from tests.support.engine import connector_config, engine, greedy, worker_connector
from tests.support.engine_pool import scheduler_connector
from tests.support.lora import make_adapter

pytestmark = pytest.mark.engine

LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}  # one adapter held at a time: another evicts it


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    return make_adapter(root / "p1", seed=1), make_adapter(root / "p2", seed=2)


def test_one_adapter_name_from_two_paths_never_shares_chunks(adapters, tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(1800)[1200:]  # 600 tokens: 4 chunks of 128 stored
    store = connector_config(f"file://{tmp_path / 'store'}", chunk_size=128)
    p1, p2 = (LoRARequest("a", 1, str(p)) for p in adapters)
    with engine(store, **LORA) as llm:
        greedy(llm, ids, lora_request=p1)  # computes and saves the prefix
        own_p1 = greedy(llm, ids, lora_request=p1)  # vLLM's local prefix cache serves the prefix
        assert worker_connector().flush()
        assert worker_connector().stats()["saved_chunks"] == 4
    with engine(store, **LORA) as llm:
        conn = worker_connector()
        served = greedy(llm, ids, lora_request=p2)
        assert conn.stats().get("loaded_tokens", 0) == 0, "P2's request loaded chunks P1's adapter computed"
        assert served == greedy(llm, ids, lora_request=p2)  # its own local-cache run
        assert conn.flush()
    with engine(store, **LORA) as llm:
        conn = worker_connector()
        assert greedy(llm, ids, lora_request=p1) == own_p1
        assert conn.stats()["loaded_tokens"] == 512  # the same name and path and weights do share


def test_an_adapter_folder_deleted_between_two_requests_is_served_and_neither_loaded_nor_saved(tmp_path: Path,
                                                                                               caplog) -> None:
    """vLLM serves an adapter it holds whatever became of its folder; the scheduler half, which has not heard of
    that load yet, cannot read the files to key its requests by: it must not raise inside vLLM's engine loop (that
    takes EngineCore down), and must not key them by name and path alone either. Once the workers report the
    weights they loaded, requests are keyed by those, folder or not."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(1250)
    prompts = [ids[i : i + 250] for i in (0, 250, 500, 750)]  # distinct: one chunk of 128 saved each
    folder = make_adapter(tmp_path / "b", seed=3)
    with engine(connector_config(f"file://{tmp_path / 'store'}", chunk_size=128), **LORA) as llm:
        conn, scheduler = worker_connector(), scheduler_connector()
        greedy(llm, prompts[0])  # the engine serves the base model
        b = LoRARequest("b", 1, str(folder))
        llm.llm_engine.add_lora(b)  # the workers load it (what vllm serve's /v1/load_lora_adapter does)
        shutil.rmtree(folder)  # a deployment removes it before its next request
        assert conn.flush()
        saved = conn.stats().get("saved_chunks", 0)
        log = logging.getLogger("vllm_kvcodec")  # following vLLM's logging, it does not propagate to pytest's
        log.addHandler(caplog.handler)
        try:
            out = llm.generate([{"prompt_token_ids": p} for p in prompts[1:3]],
                               SamplingParams(max_tokens=4, temperature=0), lora_request=b, use_tqdm=False)
        finally:
            log.removeHandler(caplog.handler)
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)  # served: no exception reached EngineCore
        assert conn.flush()
        assert conn.stats().get("loaded_tokens", 0) == 0
        assert conn.stats().get("saved_chunks", 0) == saved, "requests keyed without their weights were saved"
        assert scheduler.stats()["adapter_unreadable_requests"] == 2
        warned = {(r.created, r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING}  # a record
        assert sum("LoRA adapter 'b'" in message for _, message in warned) == 1  # may also reach vLLM's handlers
        greedy(llm, prompts[3], max_tokens=4, lora_request=b)  # keyed by the weights the workers reported
        assert conn.flush()
        assert conn.stats()["saved_chunks"] == saved + 1


def test_an_adapter_rewritten_in_place_never_stores_one_weights_kv_under_the_others_files(tmp_path: Path) -> None:
    """vLLM keeps serving the weights it loaded when an adapter's files are rewritten in place, and reads the files
    again only for another id, or for this id once it evicted it: KV is stored under the files the weights were
    read from. Both ways round: seed 1's KV must not be found by an engine that loads seed 2's files,
    nor seed 2's (read after an eviction while the scheduler half still keys the id by seed 1) by one that loads
    seed 1's."""
    from vllm.lora.request import LoRARequest

    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(900)
    first, second, third = ids[:300], ids[300:600], ids[600:900]  # two chunks of 128 each
    folder = make_adapter(tmp_path / "a", seed=1)
    a = LoRARequest("a", 1, str(folder))
    with engine(connector_config(f"file://{tmp_path / 'store'}", chunk_size=128), **LORA) as llm:
        conn = worker_connector()

        def loads_nothing(lora: LoRARequest, prompt: list[int]) -> bool:
            """A request as a fresh engine reading ``lora``'s files now would make: what does it load?"""
            assert conn.flush()
            llm.reset_prefix_cache()  # vLLM's own cache keys adapters by name and path: no local hit to hide it
            loaded = conn.stats().get("loaded_tokens", 0)
            greedy(llm, prompt, max_tokens=4, lora_request=lora)
            return conn.stats().get("loaded_tokens", 0) == loaded

        greedy(llm, first, max_tokens=4, lora_request=a)  # vLLM loads seed 1's weights
        make_adapter(folder, seed=2)  # rewritten in place; id 1 still runs seed 1
        greedy(llm, second, max_tokens=4, lora_request=a)
        assert loads_nothing(LoRARequest("a", 2, str(folder)), second), "seed 1's KV under seed 2's files' keys"
        # Id 2 evicted id 1 (one adapter held at a time): its next request makes vLLM read seed 2's files for it.
        greedy(llm, third, max_tokens=4, lora_request=a)
        assert conn.flush() and conn.stats()["saves_skipped_adapter_weights"] >= 1
        make_adapter(folder, seed=1)  # seed 1's files back
        assert loads_nothing(LoRARequest("a", 3, str(folder)), third), "seed 2's KV under seed 1's files' keys"
