"""KV pressure while a prompt is half prefilled (chunked prefill): the chunked request is
retracted before any running request, and no request is cut short ("KV cache is full")."""

from __future__ import annotations

import pytest

from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

PARAMS = {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True}


def prompts() -> list[list[int]]:
    """Four distinct 150-token prompts: each request (300 tokens) fits a 400-token pool alone,
    two do not fit together."""
    return [[1000 + (i % 50) + 7 * k for i in range(150)] for k in range(4)]


def run(sched, logprob_rid: str | None = None) -> dict:
    outs: dict = {}
    for k, p in enumerate(prompts()):
        rid = f"r{k}"
        lp = rid == logprob_rid
        submit(sched, rid, p, PARAMS, return_logprob=lp, logprob_start_len=0 if lp else -1)
    run_until_idle(sched, outs)
    return outs


def solo_runs(model: str, kw: dict, logprobs: bool) -> dict:
    """Each prompt run alone on a scheduler with a pool that fits it (the reference): rid ->
    outputs, with prompt logprobs from the first position when `logprobs`."""
    sched = make_scheduler(model, chunked_prefill_size=128, **kw)
    ref: dict = {}
    for k, p in enumerate(prompts()):
        one: dict = {}
        lp = {"return_logprob": True, "logprob_start_len": 0} if logprobs else {}
        submit(sched, f"r{k}", p, PARAMS, **lp)
        run_until_idle(sched, one)
        ref.update(one)
    return ref


@pytest.mark.parametrize(
    "overlap,spec", [(False, False), (True, False), (True, True)], ids=["sync", "overlap", "spec"]
)
def test_chunked_request_retracted_before_running_ones(tiny_model_dir, draft_dir, overlap, spec):
    """Outputs (and the restarted request's prompt logprobs, recomputed from the first
    position) equal each request run alone; the pool ends with no leak. spec: static EAGLE-3
    (K = 2) on both sides, float32 so that greedy outputs are exact across batch shapes."""
    kw: dict = {}
    if spec:
        kw = dict(
            dtype="float32",
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft_dir,
            speculative_num_steps=2,
        )
    ref = solo_runs(tiny_model_dir, kw, logprobs=True)

    sched = make_scheduler(
        tiny_model_dir,
        max_total_tokens=400,
        chunked_prefill_size=128,
        disable_overlap_schedule=not overlap,
        **kw,
    )
    restarted: list[str] = []
    real = sched.builder.retract_chunked_req

    def spy() -> None:
        restarted.append(sched.chunked_req.rid)
        real()

    sched.builder.retract_chunked_req = spy
    # the request whose prompt logprobs are checked: the last admitted, the one chunked
    outs = run(sched, logprob_rid="r1")
    assert restarted, "the scenario must put a half-prefilled request under KV pressure"
    assert sched.stats["num_retractions"] >= len(restarted)
    for rid, out in outs.items():
        assert out["finish"]["type"] == "length" and "message" not in out["finish"], out["finish"]
        assert out["output_ids"] == ref[rid]["output_ids"], rid
    got, want = outs["r1"]["input_logprobs"], ref["r1"]["input_logprobs"]
    assert [t for _, t in got] == [t for _, t in want] and got[0][0] is None
    assert [g for g, _ in got[1:]] == pytest.approx([w for w, _ in want[1:]], abs=1e-4)
    sched.kv.check_accounting()


def test_aborted_chunked_request_ends_at_its_retraction(tiny_model_dir):
    """An abort that came while the half-prefilled request's chunk was in flight (to_abort
    set) ends the request when it is retracted, instead of queueing it for a re-admission;
    the others still equal their solo runs and the pool ends with no leak."""
    ref = solo_runs(tiny_model_dir, {}, logprobs=False)
    sched = make_scheduler(tiny_model_dir, max_total_tokens=400, chunked_prefill_size=128)
    aborted: list[str] = []
    real = sched.builder.retract_chunked_req

    def spy() -> None:
        if not aborted:
            aborted.append(sched.chunked_req.rid)
            sched.chunked_req.to_abort = True
        real()
        assert all(r.rid not in aborted for r in sched.waiting_queue)

    sched.builder.retract_chunked_req = spy
    outs = run(sched)
    assert len(aborted) == 1
    for rid, out in outs.items():
        if rid in aborted:
            assert out["finish"]["type"] == "abort"
            continue
        assert out["finish"]["type"] == "length" and "message" not in out["finish"], out["finish"]
        assert out["output_ids"] == ref[rid]["output_ids"], rid
    sched.kv.check_accounting()
