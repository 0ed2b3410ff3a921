"""What a row proves at load: the tokens (and request context) it was computed from, not only vLLM's key for them.

vLLM's offload key is its block hash. A row stored under a key for other
tokens (a writer that keyed a request wrongly; with vLLM's ``xxhash`` and a
shared seed, a crafted collision), or for the same tokens under another LoRA
adapter's weights at the adapter's name and path, is intact and bound to the
key asked for: only the token digests it records tell it from the right one.
Engines are vLLM's own scheduler side with KVCodecTier
(tests/support/offload_engine.py); the tampering is done to a real store.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from tests.support.offload_engine import BLOCK
from vllm_kvcodec.format import decode_payload, encode_chunk, read_header

ROWS = 4  # blocks stored, of the prompt's 8


def test_a_row_keyed_for_another_prompt_fails_on_its_tokens(engine, tokens, blocks) -> None:
    """Q's row written under P's key, bound to it (a writer that keyed a request wrongly): intact, bound to the key
    asked for, and still refused, because it records Q's tokens. The scheduler is told of the rows before it."""
    store = f"memory://offload-{uuid.uuid4().hex}"
    other = tokens[:BLOCK] + tokens[2 * BLOCK :] + tokens[BLOCK : 2 * BLOCK]  # Q: P's first block, then others
    a = engine(store)
    p, q = a.request(tokens), a.request(other)
    a.save(p, blocks[:ROWS])
    a.save(q, blocks[ROWS:])
    s = a.tier.store
    mine, theirs = a.tier.key_of(a.keys(p)[1]), a.tier.key_of(a.keys(q)[1])
    blob = s.get(theirs)
    header = read_header(blob, key=theirs)
    s.put(mine, encode_chunk(decode_payload(blob, header), "raw", key=mine, tokens=header.tokens))
    b = engine(store)
    replay = b.request(tokens)
    assert b.hit_tokens(replay) == BLOCK  # the first block; the second is recomputed, and all after it
    assert b.tier.counters["token_mismatches"] == 1 and b.tier.counters["load_failures"] == 1
    assert torch.equal(b.loaded_rows(replay, 1)[:, : blocks.shape[1]], blocks[:1])


def _adapter(folder: Path, fill: int) -> Path:
    """A LoRA adapter folder as PEFT writes one (config and weights); only its bytes matter to the identity."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (folder / "adapter_model.safetensors").write_bytes(bytes([fill]) * 4096)
    return folder


def test_lora_requests_are_neither_stored_nor_loaded(engine, tokens, blocks, tmp_path) -> None:
    """vLLM keys blocks by the adapter's name and path, and reads an adapter's files again after evicting it: the
    files there now need not be the weights the engine runs, which only its workers know (the connector learns
    them from their reports; the tier, beside vLLM's own workers, cannot). So a LoRA request's rows are unproved:
    not stored, and never loaded, whatever the store holds under their keys."""
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("sql", 1, str(_adapter(tmp_path / "sql", 1)))
    store = f"memory://offload-{uuid.uuid4().hex}"
    a = engine(store)
    a.save(a.request(tokens), blocks[:ROWS])
    assert a.tier.counters["stored_rows"] == ROWS
    adapted = a.request(tokens, lora_request=lora)
    assert a.keys(adapted)[:ROWS] != a.keys(a.request(tokens))[:ROWS]
    a.save(adapted, blocks[:ROWS])
    assert a.tier.counters["stored_rows"] == ROWS and a.tier.counters["unproved_rows"] == ROWS
    b = engine(store)
    assert b.hit_tokens(b.request(tokens, lora_request=lora)) == 0
    assert b.hit_tokens(b.request(tokens)) == ROWS * BLOCK, "plain requests still share"


def test_a_request_the_tier_was_not_told_of_is_neither_stored_nor_looked_up(engine, tokens, blocks) -> None:
    """A request context the connector did not announce (its tokens unknown here): its rows are not stored, unread,
    and its lookups miss, whatever the store holds."""
    e = engine(f"memory://offload-{uuid.uuid4().hex}")
    known = e.request(tokens)
    keys = e.keys(known)[:ROWS]
    stranger = ReqContext(req_id="not-announced")
    for i, key in enumerate(keys):
        stranger.set_offload_key_position(key, (i + 1) * BLOCK)
    e.tier.on_new_request(stranger)
    e.rows[:ROWS, : blocks.shape[1]] = blocks[:ROWS]
    e.tier.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.arange(ROWS), is_promotion=False,
                                    req_context=stranger))
    e.tier.drain_jobs()
    assert [r.success for r in e.tier.get_finished_jobs()] == [False]
    assert e.tier.counters["unproved_rows"] == ROWS and e.tier.counters["stored_rows"] == 0
    assert not any(e.tier.store.exists_many([e.tier.key_of(k) for k in keys]))
    assert e.tier.lookup(keys[0], stranger) == LookupResult.MISS
