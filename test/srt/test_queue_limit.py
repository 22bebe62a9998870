"""--max-queued-requests in the scheduler: its waiting queue holds at most that many requests
(upstream's rule); later arrivals end at once as aborts with status_code 503, which the
tokenizer manager answers with HTTP 503 queue_full (test_http_errors.py)."""

from __future__ import annotations

from sglang.test.scheduler_utils import collect, make_scheduler, run_until_idle, submit

PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def test_waiting_queue_bound_refuses_later_arrivals(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, dtype="float32", max_queued_requests=2)
    outs: dict = {}
    for i in range(5):  # no step in between: all five arrive while nothing runs
        submit(sched, f"r{i}", [100 + i, 200, 300], PARAMS)
    collect(sched, outs)
    assert len(sched.waiting_queue) == 2
    for rid in ("r2", "r3", "r4"):
        reason = outs[rid]["finish"]
        assert reason["type"] == "abort" and reason["status_code"] == 503, reason
        assert "--max-queued-requests 2" in reason["message"]
        assert outs[rid]["output_ids"] == []
    run_until_idle(sched, outs)
    for rid in ("r0", "r1"):
        assert len(outs[rid]["output_ids"]) == 4
        assert "status_code" not in outs[rid]["finish"]
    # the queue drained: a new arrival is accepted again
    submit(sched, "r5", [105, 200, 300], PARAMS)
    run_until_idle(sched, outs)
    assert len(outs["r5"]["output_ids"]) == 4
    sched.kv.check_accounting()


def test_no_bound_by_default(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, dtype="float32")
    for i in range(8):
        submit(sched, f"r{i}", [100 + i, 200, 300], PARAMS)
    assert len(sched.waiting_queue) == 8
