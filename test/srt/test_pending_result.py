"""Launch/finish split of the workers (PendingResult): what overlap scheduling queues ahead of
the device must finish into exactly the result of the synchronous call."""

from __future__ import annotations

import time

import pytest

from sglang.srt.managers.pending_result import PendingResult
from sglang.srt.managers.schedule_batch import GenerationBatchResult
from sglang.test.scheduler_utils import make_scheduler, submit


def test_done_result_is_returned_as_is():
    res = GenerationBatchResult(next_token_ids=[5, None, 7])
    p = PendingResult.done(res)
    assert p.sampled_rows == [0, 2] and p.next_ids_device is None
    assert p.finish() is res and p.finish() is res


def test_finish_runs_once_and_times_the_step():
    calls = []

    def fin() -> GenerationBatchResult:
        calls.append(1)
        return GenerationBatchResult(next_token_ids=[1])

    p = PendingResult(fin, [0], None, launched_at=time.perf_counter() - 5.0)
    p.keep_alive = object()
    r = p.finish()
    assert p.finish() is r and len(calls) == 1
    assert 5.0 <= r.forward_time_s < 60  # from the step's launch, not from construction
    assert p.keep_alive is None  # the step's inputs are released once it finished


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.8, "top_k": 20}])
def test_launch_finish_equals_synchronous_step(tiny_model_dir, params):
    """A prefill step where one request's prompt is cut into chunks (that row does not sample)
    and one decode step: launch().finish() gives the synchronous step's tokens."""
    sched = make_scheduler(
        tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=4096,
        chunked_prefill_size=16, disable_overlap_schedule=True,
    )  # fmt: skip
    submit(sched, "a", list(range(100, 110)), {**params, "max_new_tokens": 4}, seed=1)
    submit(sched, "b", list(range(200, 230)), {**params, "max_new_tokens": 4}, seed=2)
    worker = sched.tp_worker
    checked_partial = False
    for _ in range(4):
        batch = sched.builder.get_next_batch_to_run()
        mwb = sched.builder.build_model_worker_batch(batch)
        sync = worker.forward_batch_generation(mwb)
        pending = worker.forward_batch_generation_launch(mwb)
        launched = pending.finish()
        assert launched.next_token_ids == sync.next_token_ids
        assert pending.sampled_rows == [i for i, s in enumerate(mwb.sample) if s]
        assert pending.next_ids_device.tolist() == [
            sync.next_token_ids[i] for i in pending.sampled_rows
        ]
        checked_partial |= not all(mwb.sample)
        sched.outputs.on_launch(batch)
        sched.outputs.process_batch_result(batch, sync)
    assert checked_partial  # the chunked request's first chunk did not sample
