"""Streaming-input sessions: a request that grows turn by turn (and gains images) is keyed by what it holds now.

vLLM's resumable requests take each update into the same ``Request``
(``_update_request_as_session``) with no ``request_finished`` in between. The
scheduler harness's fake model is multimodal here: an image's placeholder
positions get KV that follows the image's content hash, so a load of another
image's chunks is wrong KV, which every step checks (see
:mod:`tests.support.scheduler_harness`).
"""

from __future__ import annotations


import pytest

from tests.support.scheduler_harness import Engine, loads_of, prompt

#: Every scenario with lookups inline and on the lookup thread (tests/connector/conftest.py).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.usefixtures("lookup")]

IMAGE_AT, IMAGE_LEN = 16, 40  # in the second turn's tokens: chunks 3 and 4 of the session (chunk 32)


def session(e: Engine, req_id: str, image: str, max_tokens: int = 1) -> None:
    """Turn 1: 64 text tokens; turn 2: 64 more with an image at IMAGE_AT (its placeholders are the same tokens for
    any image); the request then waits for a third update."""
    e.add(req_id, prompt(64, 1), max_tokens=1, resumable=True)
    e.run(until=lambda eng: eng.waits_for_input(req_id))
    e.update_session(req_id, prompt(64, 2), max_tokens=max_tokens, mm=[(IMAGE_AT, IMAGE_LEN, image)])
    e.run(until=lambda eng: eng.waits_for_input(req_id), max_steps=400)


def end(e: Engine, req_id: str) -> None:
    e.update_session(req_id, None)
    e.run()


def test_chunks_a_later_image_touches_are_keyed_with_it(tmp_path, store) -> None:
    """Turn 2's chunks are saved under keys carrying its image's hash (the harness checks every save's key against
    the request's tokens and media as they are then)."""
    from vllm_kvcodec.keys.identity import prompt_identity
    from vllm_kvcodec.keys.chain import chunk_hashes, object_key

    e = Engine(tmp_path, store)
    session(e, "s1", "img-a")
    request = e.requests["s1"]
    tokens, identity = list(request.all_token_ids), prompt_identity(request)
    assert identity.media == ((64 + IMAGE_AT, "img-a"),)  # turn 1 kept no answer token (1 sampled, never computed)
    end(e, "s1")
    e.flush()
    ns = e.connector.scheduler.namespace
    keyed = chunk_hashes(ns, tokens, len(tokens) // 32, identity)
    assert all(e.connector.scheduler.store.exists(object_key(ns, h, 0, 0)) for h in keyed[:3])
    assert e.scheduler_stats()["session_updates"] >= 1
    e.assert_empty()


def test_a_preempted_session_never_loads_another_sessions_image(tmp_path, store) -> None:
    """s1 stores its session with image A; s2 has the same tokens with image B and is preempted after its update:
    its next lookup finds turn 1's chunks and not one chunk of image A's (the harness would see wrong KV)."""
    e = Engine(tmp_path, store)
    session(e, "s1", "img-a")
    end(e, "s1")
    e.flush()
    e.assert_empty()
    # 13 usable blocks of 16. s2's first turn holds 4; "other" (60 tokens, 100 to decode) starts; s2's update fits
    # (128 tokens) and runs after "other", so when their decodes outgrow the blocks vLLM preempts s2, which then
    # looks the store up again.
    f = Engine(tmp_path, store, num_blocks=14)
    f.add("s2", prompt(64, 1), max_tokens=1, resumable=True)
    f.run(until=lambda eng: eng.waits_for_input("s2"))
    f.add("other", prompt(60, 9), max_tokens=100)
    f.run(until=lambda eng: eng.requests["other"].num_output_tokens > 0)
    f.update_session("s2", prompt(64, 2), max_tokens=40, mm=[(IMAGE_AT, IMAGE_LEN, "img-b")])
    f.run(until=lambda eng: eng.waits_for_input("s2") and "other" in eng.finished, max_steps=800)
    assert f.requests["s2"].num_preemptions >= 1, "the scenario needs s2 looked up again after its update"
    # Every load names chunks of s2's own prompt as it is after the update, image B's hash included (the harness
    # checks each one, and that s2 reads its own KV in every step): turn 1's chunks, stored by s1, are among them.
    assert loads_of(f, ["s2"]) and f.stats().get("load_failures", 0) == 0
    end(f, "s2")
    f.assert_empty()
