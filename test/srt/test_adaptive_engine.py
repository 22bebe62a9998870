"""Adaptive speculation (issue 7) on a real in-process scheduler (tiny Llama, random EAGLE-3
draft): --speculative-adaptive gives greedy outputs identical to no speculation (goodput,
never-pays and always-pays models), the warm-up sweep on the worker, launch step indices with
overlap scheduling, probes when every step drains, and forced switching with mixed penalties."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from sglang.srt.speculative.adaptive.policy import GoodputPolicy
from sglang.srt.speculative.adaptive.warmup import make_synthetic_step, profile_on_worker
from sglang.test.adaptive_sim import ZERO
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# Costs under which drafting can never pay / always pays, fixed (no online correction).
NEVER = {"time_model": {"verify_tokens": 1.0}, "online_correction": False}
ALWAYS = {"time_model": {**ZERO, "const": 1.0}, "online_correction": False}


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def run(tiny_model_dir, **kw) -> dict:
    sched = make_scheduler(tiny_model_dir, **kw)
    outs: dict = {}
    for i, p in enumerate(prompts(6)):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    outs["_state"] = sched.internal_state()
    return outs


@pytest.fixture(scope="module")
def spec_args(tiny_model_dir, tmp_path_factory) -> dict:
    draft = make_tiny_eagle3_dir(str(tmp_path_factory.mktemp("eagle3")), tiny_model_dir)
    return dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_num_steps=3
    )


@pytest.fixture(scope="module")
def engine_runs(tiny_model_dir, spec_args) -> dict:
    runs = {"plain": run(tiny_model_dir), "static": run(tiny_model_dir, **spec_args)}
    for name, cfg in [("goodput", None), ("never", NEVER), ("always", ALWAYS)]:
        runs[name] = run(
            tiny_model_dir,
            speculative_adaptive=True,
            speculative_adaptive_config=None if cfg is None else json.dumps(cfg),
            **spec_args,
        )
    return runs


def test_engine_adaptive_greedy_identical(engine_runs):
    ref = engine_runs["plain"]
    for name in ("static", "goodput", "never", "always"):
        outs = engine_runs[name]
        for rid in ref:
            if rid == "_state":
                continue
            assert outs[rid]["output_ids"] == ref[rid]["output_ids"], (name, rid)
            meta = outs[rid]["meta"]
            ct = meta["spec_verify_ct"]
            assert meta["spec_mean_draft_len"] == pytest.approx(
                meta["spec_num_proposed_drafts"] / ct
            )


def test_engine_adaptive_extremes(engine_runs):
    """Drafting never pays: no request proposes a draft. Always pays: every request drafts
    its cap every step, exactly what the static server proposes."""
    never, always, static = engine_runs["never"], engine_runs["always"], engine_runs["static"]
    rids = [r for r in static if r != "_state"]
    assert all(never[r]["meta"]["spec_num_proposed_drafts"] == 0 for r in rids)
    assert never["_state"]["spec_mean_draft_len"] == 0
    for r in rids:
        assert always[r]["meta"] == static[r]["meta"]
    assert static["_state"]["spec_proposed_drafts"] > 0
    state = engine_runs["goodput"]["_state"]
    assert state["spec_adaptive_policy"] == "goodput"
    assert state["spec_measured_step_time_s"] > 0 and state["spec_predicted_step_time_s"] > 0


def test_warmup_sweep_on_worker_leaves_pools_unchanged(tiny_model_dir, spec_args):
    """The startup sweep (skipped on CPU by the scheduler) runs synthetic decode and verify
    steps on the real worker (catch-up steps over several positions included), frees every
    slot, and installs fitted coefficients."""
    cfg = json.dumps({"profile_batch_sizes": [1, 2, 100000]})
    sched = make_scheduler(
        tiny_model_dir, speculative_adaptive=True, speculative_adaptive_config=cfg, **spec_args
    )
    free = (sched.allocator.available_size(), sched.req_to_token_pool.available_size())
    run_step = make_synthetic_step(sched, 16)
    assert run_step(2, 0) > 0 and run_step(3, 3) > 0
    assert run_step(3, 1, 16) > 0  # a catch-up over the whole context (the sweep's probe)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="catchup must be in 1..16"):
            run_step(1, 1, bad)
    assert (sched.allocator.available_size(), sched.req_to_token_pool.available_size()) == free
    before = sched.spec.adaptive.time_model.coefficients()
    profile_on_worker(sched, sched.spec.adaptive, context_len=16)  # 100000 does not fit
    assert sched.spec.adaptive.time_model.coefficients() != before
    assert (sched.allocator.available_size(), sched.req_to_token_pool.available_size()) == free
    outs: dict = {}
    for i, p in enumerate(prompts(2)):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs.values())


def test_overlap_commits_see_launch_step_indices(tiny_model_dir, spec_args, monkeypatch):
    """With overlap scheduling a commit comes after the next step's launch (pipelined) or
    before it (drained); the controller gets each step's launch index, so one request's decode
    steps are consecutive across pipelined and drained steps. The warm-up sweep is off, so
    CPU and CUDA use the same default step-time prior: on CUDA the sweep's fit for the tiny
    random model makes drafting never pay, and the test needs both kinds of step."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    seen: list[tuple[int, int]] = []
    observe = AdaptiveController.observe

    def spy(self, reqs, lens, acc, fwd, step_index):
        seen.append((step_index, int(sum(lens))))
        return observe(self, reqs, lens, acc, fwd, step_index)

    monkeypatch.setattr(AdaptiveController, "observe", spy)
    sched = make_scheduler(
        tiny_model_dir,
        speculative_adaptive=True,
        speculative_adaptive_config=json.dumps({"probe_every": 3, "profile": False}),
        disable_overlap_schedule=False,
        **spec_args,
    )
    outs: dict = {}
    submit(sched, "r0", prompts(1)[0], {**GREEDY, "max_new_tokens": 40})
    run_until_idle(sched, outs)
    idx = [i for i, _ in seen]
    assert len(idx) >= 20 and idx == list(range(idx[0], idx[0] + len(idx)))
    kinds = [d > 0 for _, d in seen]
    assert any(kinds) and not all(kinds)  # both pipelined (plain) and drained (drafting) steps


def test_plain_steps_are_timed_once_in_eight_and_outputs_stay_exact(
    tiny_model_dir, spec_args, monkeypatch
):
    """Overlap scheduling, a policy that never drafts: the worker gets SpecPlan.time_forward
    on the first plain step and then on one in OVERHEAD_SAMPLE_EVERY of the plain steps that
    follow a plain one, and the controller gets a forward time exactly for those (None for
    the others); greedy outputs equal the plain engine's."""
    from sglang.srt.speculative.adaptive import controller as ctl
    from sglang.srt.speculative.adaptive.step_timing import OVERHEAD_SAMPLE_EVERY
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    asked: list[bool] = []
    launch = EAGLEWorkerV2.forward_batch_generation_launch

    def spy_launch(self, mwb):
        if mwb.spec is not None and mwb.forward_mode.is_decode():
            asked.append(mwb.spec.time_forward)
        return launch(self, mwb)

    got: list[bool] = []
    observe = ctl.AdaptiveController.observe

    def spy_observe(self, reqs, lens, acc, fwd, step_index):
        got.append(fwd is not None)
        return observe(self, reqs, lens, acc, fwd, step_index)

    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation_launch", spy_launch)
    monkeypatch.setattr(ctl.AdaptiveController, "observe", spy_observe)
    sched = make_scheduler(
        tiny_model_dir,
        speculative_adaptive=True,
        speculative_adaptive_config=json.dumps(NEVER),
        disable_overlap_schedule=False,
        **spec_args,
    )
    assert sched.enable_overlap
    outs: dict = {}
    submit(sched, "r0", prompts(1)[0], {**GREEDY, "max_new_tokens": 30})
    run_until_idle(sched, outs)
    n = OVERHEAD_SAMPLE_EVERY
    assert len(asked) == 29  # one decode step per token after the prefill's
    assert asked == [True] + ([True] + [False] * (n - 1)) * 3 + [True, False, False, False]
    assert got == asked  # each commit knows whether its step was timed
    ref = make_scheduler(tiny_model_dir)
    ref_outs: dict = {}
    submit(ref, "r0", prompts(1)[0], {**GREEDY, "max_new_tokens": 30})
    run_until_idle(ref, ref_outs)
    assert outs["r0"]["output_ids"] == ref_outs["r0"]["output_ids"]


def test_probe_runs_probe_len_plain_steps_when_every_step_drains(
    tiny_model_dir, spec_args, monkeypatch
):
    """A policy that always drafts, probes after every 2 drafting steps: each probe runs
    probe_len (4) plain steps, also with a repetition penalty, under which every decode step
    drains the in-flight one (its token is read on the CPU) and the builder plans it again. A
    choice made before that drain and thrown away counted as one of the probe's steps, and
    probes ran 2 plain steps (DDPPDDPP...): the first a transition, one sample left."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    seen: list[int] = []
    observe = AdaptiveController.observe

    def spy(self, reqs, lens, acc, fwd, step_index):
        seen.append(int(sum(lens)))
        return observe(self, reqs, lens, acc, fwd, step_index)

    monkeypatch.setattr(AdaptiveController, "observe", spy)
    monkeypatch.setattr(GoodputPolicy, "choose", lambda self, view, *fns: view.caps.copy())
    cfg = {"probe_every": 2, "guard": False}
    for penalty in (1.0, 1.1):
        seen.clear()
        sched = make_scheduler(
            tiny_model_dir,
            speculative_adaptive=True,
            speculative_adaptive_config=json.dumps(cfg),
            disable_overlap_schedule=False,
            **spec_args,
        )
        params = {**GREEDY, "max_new_tokens": 40, "repetition_penalty": penalty}
        submit(sched, "r0", prompts(1)[0], params)
        run_until_idle(sched, {})
        kinds = "".join("D" if d else "P" for d in seen)
        assert kinds.startswith("DDPPPPDDPPPPDD"), (penalty, kinds)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "cfg",
    [
        {"probe_every": 1, "probe_len": 2, "guard": False},
        {"probe_every": 2, "guard_min_steps": 1},
        {"probe_every": 1, "probe_len": 3, "guard_min_steps": 2, "guard_backoff": 3},
    ],
)
def test_forced_switching_mixed_penalties_matches_plain(
    tiny_model_dir, spec_args, monkeypatch, overlap, cfg
):
    """A policy that always drafts, under configs that probe and block as often as they can,
    with requests with and without penalties in one batch (the penalised ones drain every
    step): greedy outputs equal a server without speculation token for token, every plain
    step right after a drafting step (consecutive launch indices) and no other is counted in
    spec_transition_steps, and every KV slot is freed at the end."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    seen: list[tuple[int, int]] = []  # (sum of draft lengths, step index) per decode step
    observe = AdaptiveController.observe

    def spy(self, reqs, lens, acc, fwd, step_index):
        seen.append((int(sum(lens)), step_index))
        return observe(self, reqs, lens, acc, fwd, step_index)

    monkeypatch.setattr(AdaptiveController, "observe", spy)
    monkeypatch.setattr(GoodputPolicy, "choose", lambda self, view, *fns: view.caps.copy())
    ref = make_scheduler(tiny_model_dir, disable_overlap_schedule=not overlap)
    sched = make_scheduler(
        tiny_model_dir,
        speculative_adaptive=True,
        speculative_adaptive_config=json.dumps(cfg),
        disable_overlap_schedule=not overlap,
        **spec_args,
    )
    outs: dict = {}
    ref_outs: dict = {}
    for s, o in ((ref, ref_outs), (sched, outs)):
        for i, p in enumerate(prompts(4)):
            params = {**GREEDY, "max_new_tokens": 10 + 7 * i}
            if i % 2 == 0:
                params["repetition_penalty"] = 1.3
            if i == 3:
                params["frequency_penalty"] = 0.6
            submit(s, f"r{i}", p, params)
        run_until_idle(s, o)
    for rid, out in ref_outs.items():
        assert outs[rid]["output_ids"] == out["output_ids"], rid
    state = sched.internal_state()
    transitions = sum(
        1 for (d0, i0), (d1, i1) in itertools.pairwise(seen) if d0 and not d1 and i1 == i0 + 1
    )
    assert transitions > 0 and state["spec_zero_probes"] > 0
    assert state["spec_transition_steps"] == transitions
    assert state["num_used_tokens"] == 0
