"""A sync load waited for whole and not done by its deadline is abandoned then (``load_timeout_s``).

Why its own check: the engine test that shows it (the faults stream) can only
show it on a slow host. There a prefill that waited whole until the deadline
found layer 0 in place, went on, and used a late layer group if it landed
before the prefill reached it: the load neither counted as timed out nor was
abandoned, and its late objects decoded beside the prefill (what waiting whole
avoids). Here the worker half of a real connector is handed such a load.
"""

from __future__ import annotations

import time

from tests.support.scheduler_harness import Engine
from vllm_kvcodec.load.load_job import LoadJob


def test_a_whole_wait_past_its_deadline_cancels_even_with_layer_0_in_place(tmp_path) -> None:
    e = Engine(tmp_path, f"file://{tmp_path / 'store'}", load_wait="whole", layers_per_object=1, load_timeout_s=0.05)
    try:
        w = e.worker.worker
        assert len(w.groups) == 2 and w._waits_whole()
        job = LoadJob([[0], [1]], 1, ["r"])
        job.expect(0, 0, "r", "c0", [3])
        job.expect(1, 0, "r", "c0", [3])
        job.deadline = time.monotonic() + 0.05
        job.object_done(0, 0, ok=True)  # layer 0 in place; layer 1's object is late
        w._sync_job = job
        w.wait_for_layer_load(e.names[0])
        assert job.cancelled and job.done.is_set() and job.failed_blocks == {3}
        assert w.stats.totals()["load_timeouts"] == 1
        w.wait_for_layer_load(e.names[1])  # answered at once: the job is over, counted once
        assert w.get_block_ids_with_load_errors() == {3} and w.stats.totals()["load_timeouts"] == 1
    finally:
        e.shutdown()
