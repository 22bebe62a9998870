"""Adaptive speculation (issue 7): AdaptiveController on simulated decoding, without an engine:
the reuse of an all-zero choice, the bound check against buffered measurements, the previous
draft lengths, the zero probes, transition steps, wall-interval measurements, and the goodput
guard (goodput_guard.py) inside the controller and on its own."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from sglang.srt.speculative.adaptive.registry import parse_adaptive_config
from sglang.srt.speculative.adaptive.step_time_model import StepTimeModel
from sglang.test import adaptive_sim
from sglang.test.adaptive_sim import LIGHT, ZERO, K, pending_req, synthetic


# ------------------------------------------------------------------------------ all-zero reuse
def policy_runs(ctl, sizes: list[int], reqs: list) -> list[int]:
    """The steps (indices into sizes, each a batch of reqs[:bs]) on which ctl re-ran its policy
    instead of reusing an all-zero choice; every choice must be all zeros."""
    out = []
    for step, bs in enumerate(sizes):
        if not ctl.reuse_zero(reqs[:bs]):
            assert ctl.choose(reqs[:bs], [K] * bs) == [0] * bs
            out.append(step)
    return out


def test_all_zero_reuse_window_doubles_up_to_recheck_max():
    """While the policy keeps choosing all zeros, each run's reuse window doubles from
    recheck_every up to recheck_max; a smaller batch re-runs the policy at once but keeps the
    window (thirty-eighth session: the reset cost 4-5 runs per finished request below 8
    requests); drafting resets it to recheck_every."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    # recheck_margin 0: the shrink rule alone (with the default margin a shrink of a choice
    # this far from paying waits for the window; see the recheck_margin test)
    cfg = {"recheck_every": 2, "recheck_max": 8, "recheck_margin": 0}
    ctl = AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=8)
    nothing_pays = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)
    ctl.time_model = nothing_pays
    reqs = [pending_req(i) for i in range(6)]

    def runs_over(n: int, batch: list) -> list[int]:
        """Steps (0-based) among the next n at which the policy runs."""
        out = []
        for step in range(n):
            if not ctl.reuse_zero(batch):
                assert ctl.choose(batch, [K] * len(batch)) == [0] * len(batch)
                out.append(step)
        return out

    # windows 2, 4, 8, 8, ...: runs at steps 0, 2, 6, 14, 22
    assert runs_over(24, reqs[:4]) == [0, 2, 6, 14, 22]
    assert runs_over(1, reqs[:3]) == [0]  # smaller batch: runs at once, the window stays 8
    assert runs_over(16, reqs[:3]) == [7, 15]  # 8 steps after the shrink's run, then 8 more
    ctl.time_model = LIGHT
    steps = 0
    while ctl.reuse_zero(reqs[:3]):  # the zero choice runs out ...
        steps += 1
    assert steps <= 8 and min(ctl.choose(reqs[:3], [K] * 3)) > 0  # ... and drafting resumes
    ctl.time_model = nothing_pays
    assert runs_over(3, reqs[:3]) == [0, 2]  # after drafting the window starts at 2 again


def test_all_zero_choice_survives_small_dips_of_a_large_batch():
    """recheck_shrink: at batch 64 an all-zero choice is reused while the batch stays at 56 or
    more (a dip of up to 1/8, as requests finish and their successors are still in prefill);
    55 re-runs the policy at once. recheck_shrink 0 re-runs on any shrink."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    reqs = [pending_req(i) for i in range(64)]
    nothing_pays = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)
    dips = [64, 63, 57, 55, 64, 60, 58, 57, 56]
    for shrink, expected in ((0.125, [0, 3, 7]), (0.0, [0, 1, 2, 3, 7, 8])):
        cfg = {"recheck_every": 4, "recheck_max": 4, "recheck_shrink": shrink, "recheck_margin": 0}
        ctl = AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=64)
        ctl.time_model = nothing_pays
        # 0.125: runs at 0 (the first), 3 (55 < 64 - 8: a shrink, inside the window) and 7
        # (the window of 4 from step 3 is over); 0: at every new low too (63, 57, 55, 56)
        assert policy_runs(ctl, dips, reqs) == expected, shrink


def test_recheck_margin_lets_a_far_all_zero_choice_survive_shrinks():
    """recheck_margin: when the last all-zero run's bound check put drafting at most that
    fraction of the plain rate, a shrink of more than recheck_shrink waits for the window
    (no run) unless the batch fell below half; where drafting is close to
    paying (bound ratio above the margin) a shrink re-runs as without it. On by default (0.8,
    thirty-seventh session): None in the config below is the default."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    reqs = [pending_req(i) for i in range(16)]
    # bound ratios (best drafting rate the bound allows / plain rate) at bs 7-16: far < 0.01
    # (drafting costs a second), near 0.84 (drafting costs 2.3 ms more than a 1 ms step)
    far = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)
    near = synthetic(const=1e-3, spec_on=2.3e-3)
    sizes = [16, 13, 12, 16, 16, 9, 7, 16]
    for margin, model, expected in (
        (0.0, far, [0, 1, 5, 6]),  # off: 13 < 16 - 2 re-runs, and so do 9 and 7
        (0.8, far, [0, 6]),  # 13 and 12 wait; 9 is above half of 16; 7 is not
        (None, far, [0, 6]),  # the default is 0.8
        (0.8, near, [0, 1, 5, 6]),  # the bound ratio is above the margin at 13
    ):
        cfg = {"recheck_every": 32, "recheck_max": 32}
        if margin is not None:
            cfg["recheck_margin"] = margin
        ctl = AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=16)
        ctl.time_model = model
        assert policy_runs(ctl, sizes, reqs) == expected, (margin, ctl.reuse.ratio)
        ratio = ctl.info()["spec_zero_bound_ratio"]
        assert ratio is not None and 0 < ratio <= 1
        assert ctl.info()["spec_policy_runs"] == len(expected)


def test_recheck_margin_re_runs_when_the_requests_that_stay_could_pay():
    """recheck_margin keeps an all-zero choice over a shrink only when ratio * old batch <=
    new batch, which the bound check's own assumptions make safe whichever requests left.
    A review's case: 16 requests, 8 with acceptance 0.9 and 8 with 0.05, bound ratio 0.79;
    when the 8 poor ones finish, drafting pays for the 8 that stay (the old rule, half the
    batch or more, reused the zeros for up to a window). A shrink to 13 is provably safe
    (0.79 x 16 / 13 < 1): reused with the margin, re-run (to zeros again) without."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    reqs = [pending_req(i) for i in range(16)]
    alphas = np.array([[0.9] * K] * 8 + [[0.05] * K] * 8)  # by request slot
    for margin, expected in ((None, ["zeros", "reuse", "drafts"]), (0, ["zeros"] * 2 + ["drafts"])):
        cfg = {"recheck_every": 32, "recheck_max": 128}
        if margin is not None:
            cfg["recheck_margin"] = margin
        ctl = AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=16)
        ctl.time_model = synthetic(const=1e-3, spec_on=2.25e-3)
        ctl.tracker.alphas = lambda slots: alphas[slots]
        seen = []
        for batch in (reqs, reqs[:13], reqs[:8]):
            if ctl.reuse_zero(batch):
                seen.append("reuse")
                continue
            d = ctl.choose(batch, [K] * len(batch))
            seen.append("drafts" if any(d) else "zeros")
            if len(batch) == 16:
                assert 0.75 < ctl.reuse.ratio < 0.8  # within the default margin
        assert seen == expected, margin


def test_all_zero_choice_is_reused_until_the_batch_shrinks_or_the_recheck():
    """recheck_every: an all-zero decision skips the policy (and the caps) for the next
    recheck_every - 1 steps while the batch has at least as many requests (new requests,
    other requests in the same slots); a smaller batch or the recheck runs it again.
    decide() is what SpecScheduler.choose_draft_lens does."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    def decide(c, rs, caps):
        return [0] * len(rs) if c.reuse_zero(rs) else c.choose(rs, caps)

    # a fixed window of 3 (recheck_max: see the next test for the doubling); recheck_margin 0:
    # a shrink re-runs however far drafting was from paying
    cfg = parse_adaptive_config(
        json.dumps({"recheck_every": 3, "recheck_max": 3, "recheck_margin": 0})
    )
    ctl = AdaptiveController(cfg, K, num_slots=8)
    nothing_pays = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)
    ctl.time_model = nothing_pays
    calls = []
    choose = ctl.policy.choose
    ctl.policy.choose = lambda v, *f: calls.append(v.size) or choose(v, *f)
    reqs = [pending_req(i) for i in range(6)]
    for _ in range(3):
        assert decide(ctl, reqs[:4], [K] * 4) == [0] * 4
    assert calls == [4]  # one policy run, then two reuses
    assert decide(ctl, reqs[:4], [K] * 4) == [0] * 4 and calls == [4, 4]  # recheck
    ctl.on_admit(4)  # a request joins: a larger batch reuses the decision
    assert decide(ctl, reqs[:5], [K] * 5) == [0] * 5 and calls == [4, 4]
    # the same size with another request in place of one that finished: reused too
    ctl.on_admit(5)
    assert decide(ctl, reqs[1:6], [K] * 5) == [0] * 5 and calls == [4, 4]
    assert decide(ctl, reqs[:4], [K] * 4) == [0] * 4 and calls == [4, 4, 4]  # recheck
    ctl.time_model = LIGHT  # drafting pays now, but the zero choice is still being reused
    assert decide(ctl, reqs[:4], [K] * 4) == [0] * 4
    assert decide(ctl, reqs[:4], [K] * 4) == [0] * 4
    assert min(decide(ctl, reqs[:4], [K] * 4)) > 0 and calls == [4, 4, 4, 4]
    ctl.time_model = nothing_pays
    assert decide(ctl, reqs[:4], [K] * 4) == [0] * 4 and len(calls) == 5  # drafted last: runs
    assert decide(ctl, reqs[:4], [K, K, K, 1]) == [0] * 4 and len(calls) == 5  # any caps
    ctl.time_model = LIGHT  # a batch of 3 is smaller: the policy runs and drafts
    assert min(decide(ctl, reqs[:3], [K] * 3)) > 0 and len(calls) == 6
    # the baselines never reuse: a tier table that drafts more for larger batches is followed
    tiers = parse_adaptive_config(json.dumps({"policy": "tiers", "tiers": {"1": 0, "4": 2}}))
    tc = AdaptiveController(tiers, K, num_slots=8)
    assert decide(tc, reqs[:2], [K] * 2) == [0, 0]
    assert decide(tc, reqs[:4], [K] * 4) == [2] * 4
    one = AdaptiveController(parse_adaptive_config('{"recheck_every": 1}'), K, num_slots=8)
    one.time_model, n = nothing_pays, []
    inner = one.policy.choose
    one.policy.choose = lambda v, *f: n.append(1) or inner(v, *f)
    for _ in range(3):
        one.choose(reqs[:4], [K] * 4)
    assert len(n) == 3


def test_controller_bound_check_does_not_resolve_the_model():
    """Under load (the bound rules drafting out) a policy run reads the step-time model's last
    solve: the plain-step measurements buffered since stay buffered (no fold, no re-solve).
    When the bound lets drafting through, the model is solved before the allocation is
    scored, as before."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    ctl = AdaptiveController(parse_adaptive_config('{"recheck_every": 1}'), K, num_slots=300)
    heavy = {**ZERO, "const": 2e-3, "verify_tokens": 1e-4, "draft_steps": 2e-4, "spec_on": 3e-4}
    ctl.time_model = StepTimeModel(heavy)  # online: learns from observe()
    reqs = [pending_req(i) for i in range(256)]
    for step in range(5):
        ctl.observe(reqs, [0] * 256, [0] * 256, 0.03, step)
    model = ctl.time_model
    buffered = len(model._rows)
    assert buffered == 5
    assert ctl.choose(reqs, [K] * 256) == [0] * 256
    assert len(model._rows) == buffered  # the bound read the last solve
    light = {**ZERO, "const": 1e-2, "verify_tokens": 1e-4, "draft_steps": 2e-4, "spec_on": 3e-4}
    ctl.time_model = model = StepTimeModel(light)
    for step in range(5, 8):
        ctl.observe(reqs[:1], [0], [0], 0.01, step)
    assert len(model._rows) == 3
    assert ctl.choose(reqs[:1], [K]) != [0]  # drafting passes the bound: scored fresh
    assert len(model._rows) == 0 and not model._dirty


def test_prev_draft_lens_follow_every_observed_step():
    """AdaptiveController.prev (the hysteresis input: last d per request slot, -1 for a new
    request) equals a plain dict replay of the steps, although plain steps only write the
    slots whose prev is not already 0."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    rng = random.Random(5)
    c = AdaptiveController(parse_adaptive_config(None), 4, 12)
    ref = {s: -1 for s in range(12)}
    for step in range(300):
        if rng.random() < 0.1:  # a new request takes a slot
            slot = rng.randrange(12)
            c.on_admit(slot)
            ref[slot] = -1
        slots = rng.sample(range(12), rng.randint(1, 12))
        drafting = rng.random() < 0.3
        lens = [rng.randint(0, 4) if drafting else 0 for _ in slots]
        acc = [rng.randint(0, d) for d in lens]
        reqs = [pending_req(s, kv_len=50) for s in slots]
        c.observe(reqs, lens, acc, 1e-3, step)
        ref.update(zip(slots, lens, strict=True))
        assert c.prev.tolist() == [ref[s] for s in range(12)]


# ------------------------------------------------------------------------------ simulated decoding
class _Draft:
    draft_kv_len = 99  # one pending position (kv_len 100)
    stale = False


class _Req:
    def __init__(self, slot: int) -> None:
        self.req_pool_idx, self.kv_len, self.draft = slot, 100, _Draft()


def simulate_controller(
    monkeypatch,
    cfg: dict,
    steps: int,
    alpha: float,
    costs: tuple[float, float, float] = (2e-3, 9e-3, 2e-3),
    stats: dict | None = None,
    policy=None,
) -> list[int]:
    """One request decoding `steps` steps under the goodput controller; the true cost of a
    step is costs = (plain, drafting, plain right after a drafting step) seconds (default:
    2 ms plain and 9 ms drafting, SmolLM2 at batch 1 on the H200 in the seventh session), a
    fake clock advances by it, and each draft position is accepted with probability alpha.
    Returns the sum of draft lengths of every step; stats (if given) gets the tokens
    committed and the seconds taken; policy (if given) replaces the goodput policy's choose
    (view -> [n] draft lengths)."""
    from sglang.srt.speculative.adaptive import controller as ctl

    clock = [0.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    c = ctl.AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=1)
    if policy is not None:
        c.policy.choose = lambda view, *fns: policy(view)
    rng = random.Random(5)
    req, out, tokens = _Req(0), [], 0
    plain_s, draft_s, transition_s = costs
    for step in range(steps):
        (d,) = c.choose([req], [K])
        accepted = 0
        while accepted < d and rng.random() < alpha:
            accepted += 1
        clock[0] += draft_s if d else transition_s if out and out[-1] else plain_s
        c.observe([req], [d], [accepted], 1e-3, step)
        out.append(d)
        tokens += 1 + accepted
    if stats is not None:
        stats.update(tokens=tokens, seconds=clock[0], controller=c)
    return out


# A prior that over-estimates the plain step (12 ms of constant cost, like the H200 fit).
WRONG_PRIOR = {
    "time_model": {"const": 12e-3, "verify_tokens": 1e-4, "draft_steps": 3e-4, "spec_on": 5e-4}
}


def test_zero_probe_corrects_an_over_estimated_plain_step(monkeypatch):
    """Drafting (1.4 tokens per 9 ms) loses to a 2 ms plain step, but a prior that puts
    12 ms into every step says otherwise. The controller learns from wall intervals; after
    probe_every drafting steps in a row it runs probe_len plain steps, learns their real cost
    and stops drafting. Without probes it drafts for ever (the test can fail)."""
    cfg = {**WRONG_PRIOR, "guard": False}  # the probes alone (the guard: below)
    probed = simulate_controller(monkeypatch, {**cfg, "probe_every": 16}, 300, 0.4)
    assert probed[0] > 0  # the prior makes it draft first
    assert sum(d > 0 for d in probed[-150:]) <= 15
    never = simulate_controller(monkeypatch, {**cfg, "probe_every": 0}, 300, 0.4)
    assert sum(d > 0 for d in never[-150:]) > 140


# The warm-up fit of an adaptive FlashInfer server on the H200 (twentieth session): a plain
# step of 1.39 ms (synthetic steps run unpipelined) and 0.75 ms more to draft.
H200_PRIOR = {"time_model": adaptive_sim.H200_PRIOR}


def test_probe_runs_past_the_transition_step(monkeypatch):
    """The H200 case of the twentieth session: pipelined plain steps take 0.8 ms, a drafting
    step 3.2 ms for ~2.3 tokens (alpha 0.6, K = 4), and a plain step right after a drafting
    step 2.2 ms (it runs unpipelined). Judged by that transition step, drafting (0.72 tokens
    per ms) beats plain steps (0.45) and the server drafted on at 0.6x; the controller must
    learn plain steps from the probe's later steps and deliver at least 0.9x the plain rate
    (1.25 tokens per ms) over the run, drafting in few of its last 600 steps. The guard alone
    gets there at alpha 0.6, so the step-time model's part is checked with the guard off."""
    costs = (0.8e-3, 3.2e-3, 2.2e-3)
    stats: dict = {}
    out = simulate_controller(monkeypatch, H200_PRIOR, 1200, 0.6, costs, stats)
    assert out[0] > 0  # the prior makes it draft first
    assert sum(d > 0 for d in out[-600:]) <= 30
    assert stats["tokens"] / stats["seconds"] >= 0.9 * (1 / 0.8e-3)
    c = stats["controller"]
    assert c.num_transition_steps >= 1 and c.info()["spec_transition_steps"] == (
        c.num_transition_steps
    )
    # the step-time model alone (guard off) at alpha 0.8 (~3.4 tokens per 3.2 ms, 1.05 per
    # ms): with the transition steps among its plain samples it drafted in 532 of the last
    # 600 steps at 0.85x (the guard above hides that: it blocks either way)
    stats = {}
    cfg = {**H200_PRIOR, "guard": False}
    out = simulate_controller(monkeypatch, cfg, 1200, 0.8, costs, stats)
    assert sum(d > 0 for d in out[-600:]) <= 30
    assert stats["tokens"] / stats["seconds"] >= 0.95 * (1 / 0.8e-3)
    # where drafting does pay (alpha 0.95: ~4.5 tokens per 3.2 ms, 1.41 per ms against 1.25)
    # it keeps drafting, the probes' plain steps aside, and the guard does not trip on a
    # trial's noise
    stats = {}
    out = simulate_controller(monkeypatch, H200_PRIOR, 1200, 0.95, costs, stats)
    assert sum(d > 0 for d in out[-600:]) >= 600 * 32 / 36 - 8
    assert stats["tokens"] / stats["seconds"] >= 1.05 * (1 / 0.8e-3)
    assert stats["controller"].guard.num_trips == 0


def test_guard_charges_the_switch_back_to_the_drafting_run(monkeypatch):
    """A policy that drafts every other step, e.g. one whose model, like the step-time model,
    has no feature for what leaving a drafting step costs. On the H200 costs of
    test_probe_runs_past_the_transition_step at acceptance 0.95 a drafting step delivers 4.5
    tokens per 3.2 ms (1.41 per ms) against 1.25 for pipelined plain steps, but each plain
    step after one runs unpipelined (2.2 ms), so the alternation delivers 5.5 tokens per 5.4
    ms: 0.81x. Leaving that step out of every rate hid the loss for good (no trip, 0.82x over
    the run); the guard charges it to the drafting run it ends, blocks, and the run delivers
    at least 0.9x."""
    costs = (0.8e-3, 3.2e-3, 2.2e-3)
    stats: dict = {}
    flapping = lambda view: np.where(view.prev > 0, 0, view.caps)  # noqa: E731
    cfg = {**H200_PRIOR, "recheck_every": 1}
    out = simulate_controller(monkeypatch, cfg, 1200, 0.95, costs, stats, flapping)
    assert out[:4] == [K, 0, K, 0]
    c = stats["controller"]
    assert c.guard.num_trips >= 1
    assert stats["tokens"] / stats["seconds"] >= 0.9 * (1 / 0.8e-3)
    # the transition joins the last drafting sample: the trial's rate and standard error are
    # those of the merged sample (its sums of squares updated), and a trial with no sample
    # (a verdict was just taken) gets nothing
    from sglang.srt.speculative.adaptive.goodput_guard import GoodputGuard, _Bucket

    g = GoodputGuard(margin=0.03, min_steps=16, backoff=256, backoff_max=8192)
    g.end_run(1, 1, 2.2e-3)
    g.observe(1, True, 5, 3e-3)
    g.observe(1, True, 3, 3.4e-3)
    g.end_run(1, 1, 2.2e-3)
    ref = _Bucket()
    ref.add_draft(5, 3e-3)
    ref.add_draft(4, 5.6e-3)
    assert g.buckets[1].draft_rate() == pytest.approx(ref.draft_rate(), rel=1e-9)


def test_guard_blocks_drafting_a_model_cannot_unlearn(monkeypatch):
    """A fixed model (online correction off, so no probes either) that says drafting pays
    while it delivers 1.4 tokens per 9 ms against 1 per 2 ms: without the guard it drafts in
    every step; with it, after guard_min_steps drafting steps and a few plain ones (the guard's
    own plain steps: it had no plain rate), drafting is blocked for guard_backoff steps, then
    tried again for guard_min_steps steps, and blocked twice as long."""
    cfg = {**WRONG_PRIOR, "online_correction": False, "guard_min_steps": 8, "guard_backoff": 40}
    unguarded = simulate_controller(monkeypatch, {**cfg, "guard": False}, 400, 0.4)
    assert sum(d > 0 for d in unguarded) == 400
    guarded = simulate_controller(monkeypatch, cfg, 400, 0.4)
    drafting = [i for i, d in enumerate(guarded) if d > 0]
    assert guarded[0] > 0 and len(drafting) <= 8 * 5  # trials of 8 steps
    gaps = [b - a for a, b in zip(drafting, drafting[1:], strict=False) if b - a > 1]
    # the guard's plain steps: two probes of 4 (4 samples needed; the first step after
    # drafting is a transition, no sample), then blocks of 40 and 80 steps between trials
    assert gaps[0] == 2 * 4 + 1 and gaps[1] == 40 + 1 and gaps[2] == 80 + 1


def test_guard_keeps_drafting_that_delivers(monkeypatch):
    """Drafting that delivers (high acceptance, 2.5 ms per drafting step against 2 ms plain:
    the simulation's costs patched) is never blocked: the guard only holds measured rates
    against each other."""
    from sglang.srt.speculative.adaptive import controller as ctl

    clock = [0.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    cfg = {**WRONG_PRIOR, "online_correction": False, "guard_min_steps": 8}
    c = ctl.AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=1)
    req, rng, drafted = _Req(0), random.Random(3), 0
    for step in range(300):
        (d,) = c.choose([req], [K])
        accepted = sum(1 for _ in range(d) if rng.random() < 0.9)
        clock[0] += 2.5e-3 if d else 2e-3
        c.observe([req], [d], [accepted], 1e-3, step)
        drafted += d > 0
    assert c.guard.num_trips == 0 and drafted >= 290
    assert c.info()["spec_guard_trips"] == 0 and c.info()["spec_guard_blocked_bs"] == []


def test_guard_leaves_a_long_catch_up_step_out(monkeypatch):
    """Drafting that beats plain steps by 4% (2 tokens per 9.6 ms against 1 per 5 ms) after a
    first drafting step that also catches up over 500 positions (2 tokens in 18.2 ms): the
    guard judges the steady steps only (its verdict comes after 16 of them) and keeps
    drafting; the policy spreads that one-time cost over the request's next steps. (In the
    guard's former EMA of drafting rates that step weighed 0.9^15 = 0.21 of the verdict and
    blocked drafting, a review helper's case. A trial's tokens over seconds would spread it
    over the trial: 197 tokens/s against a bar of 194, kept either way, so here only the
    sample count shows that it is left out.)"""
    from sglang.srt.speculative.adaptive import controller as ctl

    clock = [0.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    cfg = {"guard_min_steps": 16, "guard_margin": 0.03, "online_correction": False}
    c = ctl.AdaptiveController(parse_adaptive_config(json.dumps(cfg)), K, num_slots=1)
    req, step = _Req(0), 0
    req.draft.draft_kv_len = req.kv_len - 1
    for _ in range(10):  # plain steps: 200 tokens/s
        clock[0] += 5e-3
        c.observe([req], [0], [0], 1e-3, step)
        step += 1
    for i in range(17):  # the first after a 500-position lag, then 16 steady ones
        req.draft.draft_kv_len = req.kv_len - (500 if i == 0 else 2)
        clock[0] += 18.2e-3 if i == 0 else 9.6e-3
        c.observe([req], [2], [1], 1e-3, step)
        step += 1
        if i == 15:
            assert c.guard.buckets[1].draft_n == 15  # the catch-up step is no sample
    assert c.guard.buckets[1].draft_n == 0  # a verdict was taken (its samples start over)
    assert c.guard.num_trips == 0 and not c.guard.blocks(1)


def test_controller_learns_wall_intervals(monkeypatch):
    """count_overhead (default): a consecutive step's measured time is the wall interval since
    the previous decode commit, not its forward time; off: the forward time."""
    from sglang.srt.speculative.adaptive import controller as ctl

    clock = [10.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    for count, want in ((True, 5e-3), (False, 1e-3)):
        cfg = parse_adaptive_config(json.dumps({"count_overhead": count}))
        c = ctl.AdaptiveController(cfg, K, num_slots=1)
        c.observe([_Req(0)], [0], [0], 1e-3, 7)
        clock[0] += 5e-3
        c.observe([_Req(0)], [0], [0], 1e-3, 8)
        assert c.info()["spec_measured_step_time_s"] == pytest.approx(want)
        assert c.info()["spec_forward_time_s"] == pytest.approx(1e-3)


def test_plain_steps_after_plain_ones_are_timed_once_in_eight(monkeypatch):
    """wants_forward_time: a plain step that follows a plain one is timed once in
    OVERHEAD_SAMPLE_EVERY; every other step always (the first plain step after a drafting step
    or a prefill, a drafting step, and every step without count_overhead). An untimed step
    (forward time None) is still measured by its wall interval and feeds the model and the
    guard, but not the overhead EMA; without an interval it is no sample at all."""
    from sglang.srt.speculative.adaptive import controller as ctl
    from sglang.srt.speculative.adaptive import step_timing as st

    n = st.OVERHEAD_SAMPLE_EVERY
    c = ctl.AdaptiveController(parse_adaptive_config(None), K, num_slots=1)
    got = [c.timing.wants_forward_time(True, True) for _ in range(2 * n + 1)]
    assert got == ([True] + [False] * (n - 1)) * 2 + [True]
    assert c.timing.wants_forward_time(True, False) and c.timing.wants_forward_time(False, True)
    off = ctl.AdaptiveController(parse_adaptive_config('{"count_overhead": false}'), K, num_slots=1)
    assert all(off.timing.wants_forward_time(True, True) for _ in range(2 * n))

    clock = [10.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    req = _Req(0)
    c.observe([req], [0], [0], 1e-3, 7)
    clock[0] += 5e-3
    c.observe([req], [0], [0], 1e-3, 8)  # timed: overhead sample 4 ms, weighted as 8 steps
    overhead, rows = c.timing.overhead_s, c.time_model.num_updates
    weight = 1 - (1 - st.OVERHEAD_EMA) ** n
    assert overhead == pytest.approx(weight * 4e-3)
    clock[0] += 6e-3
    c.observe([req], [0], [0], None, 9)  # untimed, consecutive: measured by its interval
    assert c.timing.overhead_s == overhead
    assert c.time_model.num_updates == rows + 1
    assert c.info()["spec_measured_step_time_s"] == pytest.approx(6e-3)
    assert c.info()["spec_forward_time_s"] == pytest.approx(1e-3)  # the last timed one
    c.observe([req], [0], [0], None, 20)  # untimed and not consecutive: no sample
    assert c.time_model.num_updates == rows + 1 and c.timing.overhead_s == overhead


def test_sampled_overhead_follows_the_per_step_mean(monkeypatch):
    """Cycles of one drafting step (2 ms of overhead around a 3 ms forward) and nine plain
    steps (0.1 ms around 1 ms), timed as wants_forward_time says: the overhead EMA stays near
    the per-step mean of 0.29 ms. Weighting each sampled plain step like one (the review's
    case) gave 0.67 ms against 0.21 with every step timed."""
    from sglang.srt.speculative.adaptive import controller as ctl

    clock = [0.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    c = ctl.AdaptiveController(parse_adaptive_config('{"guard": false}'), K, num_slots=1)
    req, step, prev_plain, seen = _Req(0), 0, False, []
    for cycle in range(40):
        for j in range(10):
            d = 1 if j == 0 else 0
            timed = c.timing.wants_forward_time(d == 0, prev_plain)
            fwd, over = (3e-3, 2e-3) if d else (1e-3, 1e-4)
            clock[0] += fwd + over
            c.observe([req], [d], [0], fwd if timed else None, step)
            step, prev_plain = step + 1, d == 0
            if cycle >= 20:
                seen.append(c.timing.overhead_s)
    mean = sum(seen) / len(seen)
    assert 0.2e-3 < mean < 0.4e-3  # the per-step mean is 0.29 ms


# ------------------------------------------------------------------------------ guard
def test_guard_buckets_batch_sizes_and_config():
    """Rates are kept per batch-size bucket (bs.bit_length()): a block at 128 leaves 1-127
    and 256 free; a step without an interval is no sample; the config validates the keys."""
    from sglang.srt.speculative.adaptive.goodput_guard import GoodputGuard

    g = GoodputGuard(margin=0.03, min_steps=4, backoff=10, backoff_max=25)
    for _ in range(2):
        g.observe(128, False, 128, 1e-3)  # 128k tokens/s plain
    for _ in range(3):
        g.observe(200, True, 150, 2e-3)  # 75k tokens/s drafting
        assert not g.blocks(130)
    g.observe(200, True, 150, None)  # not consecutive: no sample
    assert not g.blocks(130)
    g.observe(200, True, 150, 2e-3)
    assert g.blocks(128) and g.blocks(255) and not g.blocks(127) and not g.blocks(256)
    assert g.info() == {"spec_guard_trips": 1, "spec_guard_blocked_bs": ["128-255"]}
    for _ in range(10):
        g.observe(1, False, 1, 1e-3)
    assert not g.blocks(128)  # 10 steps later
    for _ in range(4):
        g.observe(128, True, 150, 2e-3)
    assert g.blocks(128) and g.buckets[8].backoff == 25  # 10 -> 20 blocked, next capped at 25
    for _ in range(4 + 20):
        g.observe(128, False, 128, 1e-3)
    for _ in range(4):
        g.observe(128, True, 300, 2e-3)  # now faster than plain
    assert not g.blocks(128) and g.buckets[8].backoff == 0 and g.num_trips == 2
    # batch size 1 is its own bucket, named as spec_drafting_by_bs names it ('1', not '1-1')
    one = GoodputGuard(margin=0.03, min_steps=4, backoff=10, backoff_max=25)
    for _ in range(2):
        one.observe(1, False, 1, 1e-3)
    for _ in range(4):
        one.observe(1, True, 1, 2e-3)
    assert one.blocks(1) and not one.blocks(2)
    assert one.info()["spec_guard_blocked_bs"] == ["1"]
    assert parse_adaptive_config('{"guard": false}').guard is False
    with pytest.raises(ValueError, match=r"'guard_margin' must be in \[0.0, 0.99\], got 1$"):
        parse_adaptive_config('{"guard_margin": 1}')
    with pytest.raises(ValueError, match=r"'guard_min_steps' must be an integer >= 1, got 0$"):
        parse_adaptive_config('{"guard_min_steps": 0}')


def test_guard_plain_rate_is_tokens_over_seconds():
    """Plain steps that all cost 0.8 ms but commit 0.3 ms late and early in turn (a commit
    waits on the next launch's host work: a policy recheck, an output flush), intervals of 0.5
    and 1.1 ms: 1250 tokens/s. Drafting steps of 4 tokens per 3 ms (1333 tokens/s, 7% more)
    are kept. An average of each plain step's rate says 1455 tokens/s (1 / s is convex) and
    blocked them. A stall counts as at most 3 plain steps' time."""
    from sglang.srt.speculative.adaptive.goodput_guard import GoodputGuard

    g = GoodputGuard(margin=0.03, min_steps=16, backoff=256, backoff_max=8192)
    for i in range(40):
        g.observe(1, False, 1, 1.1e-3 if i % 2 else 0.5e-3)
    for _ in range(16):
        g.observe(1, True, 4, 3e-3)
    assert g.buckets[1].draft_n == 0 and g.num_trips == 0  # judged, and kept
    assert g.buckets[1].plain_rate() == pytest.approx(1250, rel=0.03)
    # a 100 ms stall among 0.8 ms plain steps is clipped (3x), so drafting at 0.8x the plain
    # rate is still blocked 15 plain steps later (unclipped, the rate read 352 tokens/s)
    g = GoodputGuard(margin=0.03, min_steps=16, backoff=256, backoff_max=8192)
    for i in range(36):
        g.observe(1, False, 1, 100e-3 if i == 20 else 0.8e-3)
    assert g.buckets[1].plain_rate() > 1200
    for _ in range(16):
        g.observe(1, True, 4, 4e-3)
    assert g.num_trips == 1


def test_drafting_report_counts_each_drafting_step_in_its_batch_bucket(monkeypatch):
    """spec_drafting_by_bs: per batch-size bucket, the drafting steps, the requests that drafted
    in them, the tokens they committed, and the sums of the model's predicted time (last
    solve before the step) and of the measured wall intervals. Plain steps add nothing."""
    from sglang.srt.speculative.adaptive import controller as ctl
    from sglang.srt.speculative.adaptive.step_time_model import allocation_features

    clock = [0.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    cfg = parse_adaptive_config(json.dumps({"time_model": {"const": 1e-3, "spec_on": 2e-3}}))
    c = ctl.AdaptiveController(cfg, K, num_slots=8)
    reqs = [_Req(i) for i in range(5)]
    steps = [  # (batch, draft lengths, accepted, seconds since the last commit)
        (reqs[:2], [0, 0], [0, 0], 1e-3),
        (reqs[:2], [3, 0], [2, 0], 4e-3),
        (reqs[:2], [2, 2], [0, 1], 5e-3),
        (reqs[:5], [0, 1, 0, 0, 4], [0, 1, 0, 0, 4], 6e-3),
        (reqs[:5], [0] * 5, [0] * 5, 1e-3),
    ]
    want_pred = {"2-3": 0.0, "4-7": 0.0}
    for i, (batch, d, acc, dt) in enumerate(steps):
        clock[0] += dt
        if any(d):
            x = allocation_features(d, [1] * len(d), 100 * len(batch))
            want_pred["2-3" if len(batch) < 4 else "4-7"] += c.time_model.predict_unsolved(x)
        c.observe(batch, d, acc, 1e-3, i)
    report = c.info()["spec_drafting_by_bs"]
    assert list(report) == ["2-3", "4-7"]
    assert {k: (v["steps"], v["request_steps"], v["tokens"]) for k, v in report.items()} == {
        "2-3": (2, 3, 2 + 2 + 2 + 1),
        "4-7": (1, 2, 5 + 5),
    }
    assert report["2-3"]["measured_s"] == pytest.approx(9e-3)
    assert report["4-7"]["measured_s"] == pytest.approx(6e-3)
    for key, pred in want_pred.items():
        assert report[key]["predicted_s"] == pytest.approx(pred, abs=1e-6)


def test_drafting_cost_is_remembered_from_round_to_round():
    """Rounds at c = 16 where drafting never pays (adaptive_sim.simulate_rounds). The warm-up prior
    makes the first round draft; after that, per-regime forgetting of the step-time model
    keeps what drafting cost and no later round drafts. With one forgetting factor for all
    (time_idle_decay = time_decay) the drafting measurements fade during each round's ~400
    plain steps and every round drafts again as it fills up (the paired H200 run of the
    twenty-sixth session: 7-44 drafting request-steps per round, at 2-3x the predicted step
    time)."""
    from sglang.test.adaptive_sim import simulate_rounds

    def drafting(cfg: dict) -> list[int]:
        rounds = simulate_rounds({**H200_PRIOR, **cfg}, rounds=5, num_reqs=48)
        return [r["drafting_request_steps"] for r in rounds]

    remembered = drafting({})
    assert remembered[0] > 0 and remembered[1:] == [0, 0, 0, 0]
    forgotten = drafting({"time_idle_decay": 0.98})
    assert forgotten[0] > 0 and all(n > 0 for n in forgotten[1:])


def _controller_state(c) -> dict:
    """Everything a controller learns from observations, for comparing two controllers."""
    tm, tr = c.time_model, c.tracker
    return {
        "info": json.dumps(c.info(), sort_keys=True, default=str),
        "coef": c.time_model.coefficients(),
        "updates": tm.num_updates,
        "tracker": (tr.steps, tr.synced.tolist(), tr.req_att.tolist(), tr.req_acc.tolist()),
        "server": (tr.server_att.tolist(), tr.server_acc.tolist()),
        "prev": c.prev.tolist(),
        "nonzero": sorted(c._prev_nonzero),
        "timing": (c.timing.overhead_s, c.timing._last_commit),
        "run": (c._run_bs, c._drafting_run, c.num_transition_steps),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deferred_plain_observations_learn_exactly_what_immediate_ones_do(monkeypatch, seed):
    """A controller that defers plain steps' observations (defer_plain_steps, as the scheduler
    sets it) makes the same choices and ends in the same learnt state as one that learns from
    each at once, over a random run of admissions, plain runs, drafting steps (accepts at
    random), untimed and non-consecutive steps, under a step-time model that makes drafting
    pay at first, corrected online by measured steps that make it pay less (so the policy both
    drafts and chooses all zeros)."""
    from sglang.srt.speculative.adaptive import controller as ctl

    clock = [100.0]
    monkeypatch.setattr(ctl.time, "perf_counter", lambda: clock[0])
    cfg = parse_adaptive_config(json.dumps({"probe_every": 6, "recheck_every": 2}))
    ctls = [ctl.AdaptiveController(cfg, K, 8), ctl.AdaptiveController(cfg, K, 8, 16)]
    for c in ctls:  # learnt online from here (the default): the deferred updates matter
        c.time_model.set_prior({**ZERO, "const": 1e-3, "bs": 4e-4, "verify_tokens": 2e-5})
    rng = random.Random(seed)
    running: list = []
    step = deferred_seen = drafted = 0
    for _ in range(1500):
        if len(running) < 8 and rng.random() < 0.05:  # a request joins
            slot = min(set(range(8)) - {r.req_pool_idx for r in running})
            running.append(pending_req(slot, kv_len=rng.randrange(10, 200)))
            for c in ctls:
                c.on_admit(slot)
        if len(running) > 1 and rng.random() < 0.03:  # a request leaves
            running.pop(rng.randrange(len(running)))
        if not running:
            continue
        caps = [K] * len(running)
        lens = [None, None]
        for i, c in enumerate(ctls):
            lens[i] = [0] * len(running) if c.reuse_zero(running) else c.choose(running, caps)
        assert lens[0] == lens[1]
        d = lens[0]
        drafted += any(d)
        acc = [rng.randrange(0, x + 1) for x in d]
        clock[0] += (5e-3 if any(d) else 1e-3) * rng.uniform(0.8, 1.2)
        fwd = None if rng.random() < 0.6 and not any(d) else 8e-4
        step += 1 if rng.random() < 0.95 else 3  # now and then not consecutive
        for c in ctls:
            c.observe(running, d, acc, fwd, step)
        deferred_seen = max(deferred_seen, len(ctls[1]._deferred))
        for r, x, a in zip(running, d, acc, strict=True):  # commit: 1 + a tokens each
            r.kv_len += 1 + a
            r.draft.draft_kv_len = r.kv_len - 1 if x else r.draft.draft_kv_len
    assert deferred_seen > 1 and drafted >= 5  # the run did defer, and did draft
    assert _controller_state(ctls[0]) == _controller_state(ctls[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_request_bound_check_matches_the_policy(seed):
    """A policy run on one request whose last length was 0 (or that is new) first tries the
    bound check in plain Python (AdaptiveController._single_rules_out). Over random acceptance
    histories (drafting steps, then idle steps), step-time models, pending positions, KV
    lengths, caps and tokens left, a controller with it and one running the numpy policy only
    choose the same lengths, report the same bound ratio and rate (to rounding) and end with
    the same acceptance state; the check rules drafting out in some runs and not in others.
    The rate is read after the model learnt online past a re-solve, in half the runs: both
    rate all zeros when read, with the coefficients of that time."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController
    from sglang.srt.speculative.adaptive.step_time_model import SOLVE_EVERY, plain_step_features

    rng = random.Random(seed)
    cfg = parse_adaptive_config(None)
    ruled = drafted = 0
    for _ in range(300):
        coef = {
            f: 10 ** rng.uniform(lo, hi)
            for f, lo, hi in (
                ("const", -4, -2),
                ("bs", -6, -4),
                ("verify_tokens", -6, -4),
                ("draft_tokens", -7, -4),
                ("draft_steps", -5, -3),
                ("spec_on", -5, -2),
                ("kv_tokens", -10, -8),
                ("draft_reqs", -6, -4),
                ("long_catchup", -4, -2),
            )
        }
        history = []
        for _ in range(rng.randrange(0, 12)):
            d = rng.randrange(1, K + 1)
            history.append((d, rng.randrange(0, d + 1)))
        idle = rng.randrange(0, 40)
        kv = rng.randrange(10, 3000)
        pending = rng.choice([1, 2, K + 1, K + 2, rng.randrange(1, kv)])
        prev = rng.choice([0, -1])
        cap = rng.randrange(1, K + 1)
        left = rng.choice([None, rng.randrange(2, 600)])
        online = rng.random() < 0.5
        slot = 2
        ctls = [AdaptiveController(cfg, K, 4), AdaptiveController(cfg, K, 4)]
        ctls[1]._single_rules_out = lambda *a: False  # the numpy policy only
        req = pending_req(slot, kv_len=kv)
        req.draft.draft_kv_len = kv - pending
        out = []
        for c in ctls:
            c.time_model = StepTimeModel({**ZERO, **coef}) if online else synthetic(**coef)
            c.on_admit(slot)
            for d, a in history:
                c.tracker.observe([slot], [d], [a])
            for _ in range(idle):
                c.tracker.observe_idle()
            c.prev[slot] = prev
            out.append(c._run_policy([req], [cap], None if left is None else [left]))
            if online:  # past a re-solve before the rate is read
                for i in range(SOLVE_EVERY + 8):
                    c.time_model.update(plain_step_features(1, kv + i), 2e-3)
        assert out[0] == out[1]
        p0, p1 = ctls[0].policy, ctls[1].policy
        if p1.last_bound_ratio is None:
            assert p0.last_bound_ratio is None
            drafted += any(out[0])
        else:
            assert p0.last_bound_ratio == pytest.approx(p1.last_bound_ratio, rel=1e-12)
            ruled += 1
        assert p0.last_predicted_rate == pytest.approx(p1.last_predicted_rate, rel=1e-12)
        t0, t1 = ctls[0].tracker, ctls[1].tracker
        assert t0.synced.tolist() == t1.synced.tolist()
        assert t0.req_att.tolist() == t1.req_att.tolist()
        assert t0.req_acc.tolist() == t1.req_acc.tolist()
    assert ruled >= 30 and drafted >= 30
