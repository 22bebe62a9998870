"""BatchBuilder's per-step sampling rows: reused across decode steps only while that cannot
change what is sampled (the same requests, all greedy, no logits processor)."""

from __future__ import annotations

import random

import pytest

from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def record_infos(sched) -> list[tuple[tuple[str, ...], object, bool]]:
    """(request ids, sampling info, is decode) of every step the scheduler builds."""
    seen = []
    real = sched.builder.build_model_worker_batch

    def build(batch):
        mwb = real(batch)
        rids = tuple(r.rid for r in batch.reqs)
        seen.append((rids, mwb.sampling_info, not batch.forward_mode.is_extend()))
        return mwb

    sched.builder.build_model_worker_batch = build
    return seen


def run(sched, params: list[dict]) -> dict:
    outs: dict = {}
    for i, (p, sp) in enumerate(zip(prompts(len(params)), params, strict=True)):
        submit(sched, f"r{i}", p, sp)
    run_until_idle(sched, outs)
    return {rid: o["output_ids"] for rid, o in outs.items()}


def test_greedy_rows_reused_while_the_batch_is_unchanged(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, dtype="float32")
    seen = record_infos(sched)
    lens = [12, 5, 9]  # requests finish at different steps: the batch shrinks twice
    outs = run(sched, [{**GREEDY, "max_new_tokens": n} for n in lens])
    assert [len(outs[f"r{i}"]) for i in range(3)] == lens
    decode = [(rids, info) for rids, info, is_decode in seen if is_decode]
    reused = sum(a[1] is b[1] for a, b in zip(decode, decode[1:], strict=False))
    for (rids_a, info_a), (rids_b, info_b) in zip(decode, decode[1:], strict=False):
        if rids_a == rids_b:
            assert info_b is info_a  # same requests, all greedy: the rows are not rebuilt
        else:
            assert info_b is not info_a and info_b.batch_size == len(rids_b)
    assert reused >= 6
    # same outputs as a scheduler that builds fresh rows every step
    fresh = make_scheduler(tiny_model_dir, dtype="float32")
    fresh.builder.sampling_info = fresh.builder._build_sampling_info
    assert run(fresh, [{**GREEDY, "max_new_tokens": n} for n in lens]) == outs


@pytest.mark.parametrize(
    "extra, fresh_steps",
    [
        ({"temperature": 0.8, "sampling_seed": 3}, None),  # a sampled row: positions advance
        ({"frequency_penalty": 0.5}, None),  # penalties read the outputs
        ({"logit_bias": {"300": 1.5}}, None),
        ({"min_new_tokens": 8}, 6),  # active for the first steps only, then reuse is fine
    ],
)
def test_rows_rebuilt_every_step_when_they_could_change(tiny_model_dir, extra, fresh_steps):
    sched = make_scheduler(tiny_model_dir, dtype="float32")
    seen = record_infos(sched)
    run(sched, [GREEDY, {**GREEDY, **extra}])
    infos = [info for _, info, is_decode in seen if is_decode]
    assert len(infos) >= 8
    must = infos[:fresh_steps] if fresh_steps else infos
    assert len({id(i) for i in must}) == len(must)  # a new info every one of these steps
    if fresh_steps:  # once min_new_tokens is reached the rows are plain greedy ones
        assert infos[-1] is infos[-2]
