"""Adaptive speculation (issue 7): the goodput policy with synthetic step-time models, the
acceptance estimates, online correction of the step-time model, the config flag, and the engine
with --speculative-adaptive giving greedy outputs identical to no speculation."""

from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_resolve import resolve_speculative_args
from sglang.srt.speculative.adaptive.acceptance import AcceptanceTracker, expected_tokens
from sglang.srt.speculative.adaptive.baselines import FixedKPolicy, TierPolicy
from sglang.srt.speculative.adaptive.policy import BatchView, GoodputPolicy
from sglang.srt.speculative.adaptive.registry import parse_adaptive_config
from sglang.srt.speculative.adaptive.step_time_model import (
    FEATURES,
    StepTimeModel,
    allocation_features,
    profile_step_time,
    step_features,
)
from sglang.srt.speculative.adaptive.warmup import make_synthetic_step, profile_on_worker
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

K = 4
ZERO = dict.fromkeys(FEATURES, 0.0)


def synthetic(**coef: float) -> StepTimeModel:
    return StepTimeModel({**ZERO, **coef}, online=False)


# Step time dominated by verify tokens (a large batch on a compute-bound GPU).
HEAVY = synthetic(const=2e-3, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4, spec_on=3e-4)
# Step time dominated by the fixed cost of a forward (one request, memory-bound).
LIGHT = synthetic(const=1e-2, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4, spec_on=3e-4)


def pending_req(slot: int, kv_len: int = 10) -> SimpleNamespace:
    """A running request as the controller reads it (duck-typed), one position pending."""
    draft = SimpleNamespace(draft_kv_len=kv_len - 1, stale=False)
    return SimpleNamespace(req_pool_idx=slot, kv_len=kv_len, draft=draft)


def view(alphas, caps=None, prev=None, pending=None) -> BatchView:
    a = np.asarray(alphas, dtype=np.float64)
    if a.ndim == 1:
        a = np.repeat(a[:, None], K, axis=1)
    n = len(a)
    return BatchView(
        caps=np.full(n, K) if caps is None else np.asarray(caps),
        alphas=a,
        pending=np.ones(n, dtype=np.int64) if pending is None else np.asarray(pending),
        prev=np.full(n, -1) if prev is None else np.asarray(prev),
        kv_tokens=0,
    )


# ------------------------------------------------------------------------------ policy
def test_heavy_load_picks_all_zeros():
    d = GoodputPolicy().choose(view([0.8] * 256), HEAVY.predict)
    assert d.tolist() == [0] * 256


def test_light_load_picks_k():
    for alpha in (0.5, 0.8, 0.95):
        assert GoodputPolicy().choose(view([alpha]), LIGHT.predict).tolist() == [K]
    assert GoodputPolicy().choose(view([0.8] * 4), LIGHT.predict).tolist() == [K] * 4


def test_nothing_pays_without_acceptance():
    """A draft that is never accepted never pays, even under light load."""
    assert GoodputPolicy().choose(view([0.001] * 3), LIGHT.predict).tolist() == [0, 0, 0]


def test_in_between_higher_acceptance_drafts_longer():
    mid = synthetic(const=4e-3, verify_tokens=1e-4, draft_tokens=1e-5, draft_steps=2e-4)
    alphas = [0.95, 0.3, 0.9, 0.5, 0.2, 0.8] * 8  # 48 requests
    d = GoodputPolicy().choose(view(alphas), mid.predict)
    assert 0 < d.sum() < K * len(alphas)  # neither all zeros nor all K
    by_alpha = {a: set(d[[i for i, x in enumerate(alphas) if x == a]].tolist()) for a in alphas}
    assert all(len(v) == 1 for v in by_alpha.values())  # equal estimates, equal lengths
    lens = [by_alpha[a].pop() for a in sorted(by_alpha)]  # ascending alpha
    assert lens == sorted(lens) and lens[0] < lens[-1]
    assert lens[0] == 0 and lens[-1] >= 2


def test_greedy_prefix_matches_brute_force():
    """On small batches the chosen allocation's predicted tokens/s equals the best of all
    (K + 1)^n allocations (the cost model's draft_steps = max d and its cost per drafting
    request make this non-trivial: the greedy order alone misses concentrated allocations)."""
    rng = np.random.default_rng(0)
    per_request = synthetic(const=2e-3, verify_tokens=1e-4, draft_steps=3e-4, draft_reqs=1.5e-3)
    models = [HEAVY, LIGHT, synthetic(const=1e-3, verify_tokens=1e-4, draft_steps=3e-4)]
    models.append(per_request)  # favours few requests drafting deep (request-major order)
    for trial in range(60):
        n = 3
        v = view(rng.uniform(0.2, 0.99, size=(n, K)), caps=rng.integers(0, K + 1, size=n))
        model = models[trial % 4]
        d = GoodputPolicy.best_allocation(v, model.predict)
        assert (d <= v.caps).all()
        best = max(
            GoodputPolicy.rate(v, np.array(c), model.predict)
            for c in itertools.product(*[range(c + 1) for c in v.caps])
        )
        assert GoodputPolicy.rate(v, d, model.predict) == pytest.approx(best, rel=1e-3)


def test_per_request_caps_hold():
    caps = [0, 1, 2, 3, 4, 0, 2]
    d = GoodputPolicy().choose(view([0.9] * 7, caps=caps), LIGHT.predict)
    assert d.tolist() == caps  # light load: every request drafts exactly its cap
    d = GoodputPolicy().choose(view([0.9] * 7, caps=caps, prev=[4] * 7), LIGHT.predict)
    assert d.tolist() == caps  # a previous choice above this step's cap is clipped
    assert FixedKPolicy(3).choose(view([0.9] * 7, caps=caps), LIGHT.predict).tolist() == [
        0,
        1,
        2,
        3,
        3,
        0,
        2,
    ]


def break_even_model() -> StepTimeModel:
    """A model under which drafting for 32 requests at alpha 0.6 breaks even with not drafting
    (found by bisection on the verify-token cost)."""
    lo, hi = 1e-6, 1e-3
    for _ in range(60):
        mid = (lo + hi) / 2
        m = synthetic(const=3e-3, verify_tokens=mid, draft_steps=2e-4, spec_on=2e-4)
        v = view([0.6] * 32)
        gain = GoodputPolicy.rate(v, GoodputPolicy.best_allocation(v, m.predict), m.predict)
        if gain > GoodputPolicy.rate(v, np.zeros(32, dtype=np.int64), m.predict):
            lo = mid
        else:
            hi = mid
    return synthetic(const=3e-3, verify_tokens=lo, draft_steps=2e-4, spec_on=2e-4)


@pytest.mark.parametrize("hysteresis,max_switches", [(0.02, 0), (0.0, None)])
def test_hysteresis_prevents_flapping(hysteresis, max_switches):
    """A stable workload near break-even, with +-1% noise in the acceptance estimates."""
    model = break_even_model()
    policy = GoodputPolicy(hysteresis)
    rng = np.random.default_rng(1)
    prev = np.full(32, -1)
    switches = 0
    for step in range(60):
        alphas = 0.6 + rng.uniform(-0.01, 0.01, size=32)
        d = policy.choose(view(alphas, prev=prev), model.predict)
        if step > 0:
            switches += int((d != prev).any())
        prev = d
    if max_switches is not None:
        assert switches <= max_switches
    else:
        assert switches >= 5  # without hysteresis the same input flaps (the test can fail)


def test_tier_table():
    tiers = TierPolicy({1: 3, 8: 2, 32: 1, 64: 0})
    assert [tiers.k_for(b) for b in (1, 7, 8, 31, 32, 63, 64, 500)] == [3, 3, 2, 2, 1, 1, 0, 0]
    assert (
        tiers.choose(view([0.9] * 8, caps=[1] + [4] * 7), LIGHT.predict).tolist() == [1] + [2] * 7
    )


# ------------------------------------------------------------------------------ estimates
def test_expected_tokens_formula():
    a = np.array([0.9, 0.5, 0.2])
    e = expected_tokens(a)
    assert e.tolist() == pytest.approx([1, 1.9, 1.9 + 0.45, 1.9 + 0.45 + 0.09])


def test_acceptance_estimates_converge_and_prior_for_new_requests():
    true = [0.9, 0.7, 0.5, 0.3]
    tr = AcceptanceTracker(K, num_slots=4, request_decay=0.999)
    rng = random.Random(0)
    for _ in range(3000):
        a = 0
        while a < K and rng.random() < true[a]:
            a += 1
        tr.observe([0, 1], [K, 0], [a, 0])  # slot 1 never drafts
    est = tr.alphas([0, 1])
    assert est[0] == pytest.approx(true, abs=0.05)
    assert est[1] == pytest.approx(tr.server_alpha())  # no own data: the server-wide prior
    assert tr.server_alpha() == pytest.approx(true, abs=0.05)
    tr.reset_slot(0)
    assert tr.alphas([0])[0] == pytest.approx(tr.server_alpha())


def test_acceptance_counts_one_step_exactly():
    tr = AcceptanceTracker(K, num_slots=2, initial_accept=0.5, server_prior_count=2.0)
    tr.observe([0, 1], [3, 2], [1, 2])  # slot 0 rejects position 2; slot 1 accepts all
    assert tr.req_att.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert tr.req_acc.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]
    assert tr.server_alpha().tolist() == pytest.approx([3 / 4, 2 / 4, 0.5, 0.5])


# ------------------------------------------------------------------------------ step time
def random_features(rng, n: int) -> np.ndarray:
    rows = []
    for _ in range(n):
        bs = int(rng.integers(1, 128))
        d = rng.integers(0, K + 1, size=bs) * (rng.random() < 0.7)
        rows.append(allocation_features(d, np.ones(bs, dtype=np.int64), bs * 300))
    return np.stack(rows)


def test_online_correction_converges_to_changed_model():
    prior = {"const": 4e-3, "bs": 2e-5, "verify_tokens": 2e-5, "draft_tokens": 1e-5}
    model = StepTimeModel({**ZERO, **prior, "draft_steps": 4e-4, "spec_on": 5e-4})
    true = synthetic(const=9e-3, bs=1e-5, verify_tokens=8e-5, draft_steps=1e-3, spec_on=2e-3)
    rng = np.random.default_rng(2)
    test_x = random_features(rng, 50)
    err0 = np.abs(model.predict(test_x) / true.predict(test_x) - 1).max()
    noise = random.Random(3)
    for x in random_features(rng, 400):
        model.update(x, true.predict(x) * (1 + noise.uniform(-0.02, 0.02)))
    err = np.abs(model.predict(test_x) / true.predict(test_x) - 1).max()
    assert err0 > 0.3 and err < 0.05


def test_profile_sweep_recovers_synthetic_model():
    true = synthetic(const=5e-3, bs=1e-5, verify_tokens=6e-5, draft_steps=7e-4, spec_on=1e-3)
    ctx = 512

    def run_step(bs: int, d: int) -> float:
        return true.predict(step_features(bs, bs * (1 + d), bs * d, d, bs * ctx))

    coef = profile_step_time(run_step, [1, 8, 32, 128], range(K + 1), ctx, repeats=1)
    fitted = StepTimeModel(coef, online=False)
    x = random_features(np.random.default_rng(4), 40)
    # 5%: a uniform sweep cannot tell bs from verify_tokens (proportional when d = 0), which
    # matters a little for steps that mix draft lengths
    assert fitted.predict(x) == pytest.approx(true.predict(x), rel=0.05)


# ------------------------------------------------------------------------------ config
def test_config_parsing_and_validation(tmp_path):
    cfg = parse_adaptive_config('{"policy": "tiers", "tiers": {"1": 2, "16": 0}}')
    assert cfg.policy == "tiers" and cfg.tiers == {1: 2, 16: 0}
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"policy": "fixed", "fixed_k": 2}))
    assert parse_adaptive_config(str(path)).fixed_k == 2
    assert parse_adaptive_config(None).policy == "goodput"
    for bad in ('{"policy": "fixed"', '{"polcy": "fixed"}', '{"policy": "x"}', "[1]", "nope"):
        with pytest.raises(ValueError, match="--speculative-adaptive-config"):
            parse_adaptive_config(bad)
    with pytest.raises(ValueError, match="hysteresis"):
        parse_adaptive_config('{"hysteresis": -1}')
    # errors quote the value as the user wrote it (JSON true, not Python True)
    with pytest.raises(ValueError, match=r"'probe_every' must be an integer >= 0, got true$"):
        parse_adaptive_config('{"probe_every": true}')
    with pytest.raises(ValueError, match=r"'probe_every' must be an integer >= 0, got -1$"):
        parse_adaptive_config('{"probe_every": -1}')
    assert parse_adaptive_config('{"probe_every": 0}').probe_every == 0
    assert parse_adaptive_config('{"time_model": {"draft_reqs": 0.001}}').time_model == {
        "draft_reqs": 0.001
    }


@pytest.mark.parametrize(
    "text, key, shown",
    [
        ('{"hysteresis": NaN}', "hysteresis", "NaN"),  # NaN fails every < > comparison
        ('{"initial_accept": NaN}', "initial_accept", "NaN"),
        ('{"prior_strength": Infinity}', "prior_strength", "Infinity"),
        ('{"server_prior_count": -Infinity}', "server_prior_count", "-Infinity"),
        ('{"time_model": {"const": Infinity}}', "time_model.const", "Infinity"),  # hi is inf
        ('{"time_model": {"const": 1e999}}', "time_model.const", "Infinity"),  # overflows
        pytest.param(
            '{"time_model": {"const": 1' + "0" * 400 + "}}",
            "time_model.const",
            "1" + "0" * 400,
            id="int-beyond-float",
        ),
    ],
)
def test_config_rejects_non_finite_numbers(text, key, shown):
    """Python's json accepts NaN / Infinity; the config must not (found by review)."""
    msg = f"--speculative-adaptive-config: '{key}' must be a finite number, got {shown}$"
    with pytest.raises(ValueError, match=msg):
        parse_adaptive_config(text)
    a = ServerArgs(  # and start-up (server-args resolution) fails the same way
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_adaptive=True,
        speculative_adaptive_config=text,
    )
    with pytest.raises(ValueError, match=msg):
        resolve_speculative_args(a, bundled=False)


def test_server_args_validation():
    a = ServerArgs(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_adaptive=True,
        speculative_adaptive_config='{"bogus": 1}',
    )
    with pytest.raises(ValueError, match="--speculative-adaptive-config"):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(speculative_adaptive=True)
    with pytest.raises(ValueError, match="--speculative-adaptive needs"):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(speculative_adaptive_config='{"recheck_every": 2}')  # the config alone
    with pytest.raises(ValueError, match="--speculative-adaptive-config needs"):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(  # fixed_k beyond K fails at start-up, naming both
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_num_steps=3,
        speculative_adaptive=True,
        speculative_adaptive_config='{"policy": "fixed", "fixed_k": 4}',
    )
    with pytest.raises(ValueError, match="'fixed_k' 4 exceeds --speculative-num-steps 3"):
        resolve_speculative_args(a, bundled=False)
    a.speculative_adaptive_config = '{"fixed_k": 4}'  # unused by goodput: still a mistake
    with pytest.raises(ValueError, match="'fixed_k' 4 exceeds --speculative-num-steps 3"):
        resolve_speculative_args(a, bundled=False)
    a.speculative_adaptive_config = '{"policy": "fixed", "fixed_k": 3}'
    resolve_speculative_args(a, bundled=False)
    assert a.speculative_num_steps == 3


# ------------------------------------------------------------------------------ engine
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
    steps on the real worker, frees every slot, and installs fitted coefficients."""
    cfg = json.dumps({"profile_batch_sizes": [1, 2, 100000]})
    sched = make_scheduler(
        tiny_model_dir, speculative_adaptive=True, speculative_adaptive_config=cfg, **spec_args
    )
    free = (sched.allocator.available_size(), sched.req_to_token_pool.available_size())
    run_step = make_synthetic_step(sched, 16)
    assert run_step(2, 0) > 0 and run_step(3, 3) > 0
    before = sched.spec.adaptive.time_model.coefficients()
    profile_on_worker(sched, sched.spec.adaptive, context_len=16)  # 100000 does not fit
    assert sched.spec.adaptive.time_model.coefficients() != before
    assert (sched.allocator.available_size(), sched.req_to_token_pool.available_size()) == free
    outs: dict = {}
    for i, p in enumerate(prompts(2)):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs.values())


def test_idle_requests_drift_back_to_the_prior_and_are_retried():
    """Exploration: after a bad stretch a request stops drafting; its estimate then decays
    back to the (good) server-wide prior and the policy drafts for it again."""
    tr = AcceptanceTracker(K, num_slots=2, request_decay=0.999, idle_decay=0.9)
    for _ in range(50):
        tr.observe([0, 1], [K, K], [0, K])  # slot 0 always rejects, slot 1 accepts all
    bad = tr.alphas([0])[0, 0]
    assert bad < 0.3
    for _ in range(60):
        tr.observe([0, 1], [0, K], [0, K])  # slot 0 idle
    back = tr.alphas([0])[0]
    assert back[0] > bad + 0.3
    assert back == pytest.approx(tr.server_alpha(), abs=0.02)
    no_explore = AcceptanceTracker(K, num_slots=2, request_decay=0.999, idle_decay=1.0)
    for _ in range(50):
        no_explore.observe([0, 1], [K, K], [0, K])
    for _ in range(60):
        no_explore.observe([0, 1], [0, K], [0, K])
    stuck = no_explore.alphas([0])[0, 0]  # own counts dominate: still far below the prior
    assert stuck < 0.3 and stuck < tr.server_alpha()[0] - 0.4


def test_lazy_idle_decay_equals_decaying_every_idle_step():
    """The tracker applies idle decay when a row is read or drafts; the estimates equal an
    eager reference that decays every idle row on every step (random drafting pattern,
    every slot in every step as in a running batch, one slot re-admitted mid-way)."""
    rng = random.Random(0)
    slots = [0, 1, 2, 3]
    kw = dict(request_decay=0.9, idle_decay=0.8, server_decay=0.99)
    lazy = AcceptanceTracker(K, num_slots=4, **kw)
    att, acc = np.zeros((4, K)), np.zeros((4, K))  # the eager reference's per-request counts
    pos = np.arange(1, K + 1)
    for step in range(200):
        d = [rng.choice([0, 0, 0, rng.randint(1, K)]) for _ in slots]
        a = [rng.randint(0, x) for x in d]
        if step % 50 == 7:  # some steps draft nothing at all (the O(1) path)
            d, a = [0] * 4, [0] * 4
        if step == 120:
            lazy.reset_slot(2)
            att[2] = acc[2] = 0.0
        lazy.observe(slots, d, a)
        for i in slots:
            if d[i] == 0:
                att[i] *= 0.8
                acc[i] *= 0.8
            else:
                att[i] = att[i] * 0.9 + (pos <= min(a[i] + 1, d[i]))
                acc[i] = acc[i] * 0.9 + (pos <= a[i])
        if step % 13 == 0:  # reads in between do not change the result
            lazy.alphas([1, 3])
    s = lazy.prior_strength
    prior = lazy.server_alpha()[None, :]
    want = (acc + s * prior) / (att + s)
    assert np.allclose(lazy.alphas(slots), want, rtol=1e-12, atol=1e-12)


def test_all_zero_reuse_window_doubles_up_to_recheck_max():
    """While the policy keeps choosing all zeros on a batch at least as large, each run's
    reuse window doubles from recheck_every up to recheck_max; drafting or a smaller batch
    resets it to recheck_every."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    cfg = parse_adaptive_config(json.dumps({"recheck_every": 2, "recheck_max": 8}))
    ctl = AdaptiveController(cfg, K, num_slots=8)
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
    assert runs_over(1, reqs[:3]) == [0]  # smaller batch: runs at once, window back to 2
    assert runs_over(7, reqs[:3]) == [1, 5]  # 2 (from the reset run), then 4, then 8
    ctl.time_model = LIGHT
    steps = 0
    while ctl.reuse_zero(reqs[:3]):  # the zero choice runs out ...
        steps += 1
    assert steps <= 8 and min(ctl.choose(reqs[:3], [K] * 3)) > 0  # ... and drafting resumes
    ctl.time_model = nothing_pays
    assert runs_over(3, reqs[:3]) == [0, 2]  # after drafting the window starts at 2 again


def test_all_zero_choice_is_reused_until_the_batch_shrinks_or_the_recheck():
    """recheck_every: an all-zero decision skips the policy (and the caps) for the next
    recheck_every - 1 steps while the batch has at least as many requests (new requests,
    other requests in the same slots); a smaller batch or the recheck runs it again.
    decide() is what SpecScheduler.choose_draft_lens does."""

    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    def decide(c, rs, caps):
        return [0] * len(rs) if c.reuse_zero(rs) else c.choose(rs, caps)

    # a fixed window of 3 (recheck_max: see the next test for the doubling)
    cfg = parse_adaptive_config(json.dumps({"recheck_every": 3, "recheck_max": 3}))
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


def sweep_step_s(bs: int, d: int) -> float:
    """A step-time curve shaped like the H200 warm-up sweeps: slightly superlinear in tokens
    (attention, GEMMs), and a drafting step pays about 1 ms of host work per drafting request
    (catch-up inputs, per-request draft and verify bookkeeping) on top of its fixed cost."""
    tok = bs * (1 + d)
    return 1.9e-3 + 4e-6 * tok + 2e-8 * tok**1.6 + (d > 0) * (3e-3 + 6e-4 * d + 1e-3 * bs)


def test_profile_fit_is_accurate_for_plain_steps_at_every_batch_size():
    """The warm-up fit (relative error, plain-step features first, non-negative) predicts a
    plain step within 5% from batch 1 to 256 and drafting steps within 10%. The single
    absolute least-squares fit it replaced, on the same sweep, is off by more than 3x on the
    plain steps (too cheap at batch 1, 40x too dear at 256): drafting then looked free where it
    cost the most."""
    ctx, sizes = 512, [1, 4, 16, 64, 256]
    fitted = StepTimeModel(profile_step_time(sweep_step_s, sizes, range(6), ctx, repeats=1))
    xs = np.stack(
        [step_features(b, b * (1 + d), b * d, d, b * ctx) for b in sizes for d in range(6)]
    )
    ys = np.array([sweep_step_s(b, d) for b in sizes for d in range(6)])
    plain = xs[:, FEATURES.index("spec_on")] == 0
    assert fitted.predict(xs[plain]) == pytest.approx(ys[plain], rel=0.05)
    assert fitted.predict(xs[~plain]) == pytest.approx(ys[~plain], rel=0.1)
    old = [f for f in FEATURES if f != "draft_reqs"]  # the previous features and fit
    z = xs[:, [FEATURES.index(f) for f in old]]
    theta = np.maximum(np.linalg.lstsq(z, ys, rcond=None)[0], 0.0)
    ratio = (z[plain] @ theta) / ys[plain]
    assert ratio.min() < 1 / 3 or ratio.max() > 3


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
H200_PRIOR = {
    "time_model": {
        "const": 1.39e-3,
        "verify_tokens": 1.0e-6,
        "draft_tokens": 2.3e-6,
        "draft_steps": 3.6e-7,
        "spec_on": 7.5e-4,
        "draft_reqs": 3.5e-6,
    }
}


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


def test_profile_fit_reproduces_exactly_linear_steps():
    """Steps that follow the linear model exactly are reproduced (the two-stage fit moves the
    verify cost that plain steps cannot separate from bs into the drafting stage)."""
    true = synthetic(
        const=2e-3,
        bs=1e-4,
        verify_tokens=1e-6,
        draft_tokens=1e-6,
        draft_steps=5e-4,
        spec_on=1e-3,
        kv_tokens=1e-9,
        draft_reqs=2e-4,
    )
    sizes, ctx = [1, 4, 16, 64, 256], 512

    def run_step(bs: int, d: int) -> float:
        return true.predict(step_features(bs, bs * (1 + d), bs * d, d, bs * ctx))

    fitted = StepTimeModel(profile_step_time(run_step, sizes, range(6), ctx, repeats=1))
    xs = np.stack(
        [step_features(b, b * (1 + d), b * d, d, b * ctx) for b in sizes for d in range(6)]
    )
    assert fitted.predict(xs) == pytest.approx(true.predict(xs), rel=1e-3)
    # random models, some terms absent, per-request costs below the kv_tokens prior x context
    rng = np.random.default_rng(3)
    scales = [4e-3, 1e-4, 2e-4, 3e-5, 1e-3, 2e-3, 1e-8, 2e-3]
    for _ in range(60):
        coef = {
            f: float(rng.uniform(0, 1)) * sc * (rng.random() < 0.8)
            for f, sc in zip(FEATURES, scales, strict=True)
        }
        coef["const"] += 1e-4
        model, c = StepTimeModel(coef, online=False), int(rng.choice([128, 512, 2048]))
        rows = {
            (b, d): step_features(b, b * (1 + d), b * d, d, b * c) for b in sizes for d in range(6)
        }
        fit = profile_step_time(
            lambda b, d, m=model, r=rows: m.predict(r[b, d]), sizes, range(6), c, 1
        )
        xs = np.stack(list(rows.values()))
        assert StepTimeModel(fit).predict(xs) == pytest.approx(model.predict(xs), rel=0.03)


def test_model_learns_without_readers():
    """The fixed and tiers baselines never read the model: it still follows the measured steps
    (re-solved every SOLVE_EVERY updates; each measurement is clipped against the last solve)."""
    from sglang.srt.speculative.adaptive.step_time_model import SOLVE_EVERY

    model = StepTimeModel({**ZERO, "const": 6e-3})
    x = allocation_features([0, 0], [1, 1], 200)
    for _ in range(25 * SOLVE_EVERY):
        model.update(x, 0.25)
    assert model.predict_unsolved(x) == pytest.approx(0.25, rel=0.05)


def test_buffered_updates_equal_one_at_a_time_updates():
    """update() buffers measurements and folds them in batches; the statistics and the solved
    coefficients equal the eager reference (decay, then add z z^T and z y with y clipped to
    [1/3, 3] x the last solve's prediction), whether the buffer is folded by a read mid-way or
    after SOLVE_EVERY updates."""
    from sglang.srt.speculative.adaptive import step_time_model as stm

    rng = np.random.default_rng(3)
    model = StepTimeModel({**ZERO, "const": 2e-3, "bs": 1e-5})
    gram, moment, theta = model.gram.copy(), model.moment.copy(), model.theta.copy()
    n = 0
    for i in range(3 * stm.SOLVE_EVERY + 5):
        bs = int(rng.integers(1, 64))
        x = allocation_features([int(d) for d in rng.integers(0, 4, bs)], [1] * bs, 300 * bs)
        y = float(rng.choice([1e-4, 3e-3, 5e-2]))  # some clipped on either side
        z = x / stm._SCALES
        pred = max(float(z @ theta), 1e-6)
        y_c = min(max(y, pred / 3), pred * 3)
        gram = gram * model.decay + np.outer(z, z)
        moment = moment * model.decay + z * y_c
        n += 1
        model.update(x, y)
        if n % stm.SOLVE_EVERY == 0 or i == 10:  # a solve: by the cadence, or a read (i = 10)
            if i == 10:
                model.predict(x)
            theta = stm._ridge_nonneg(gram, moment, model.prior, model.prior_weight)
            np.testing.assert_allclose(model.theta, theta, rtol=1e-9, atol=1e-15)
            np.testing.assert_allclose(model.gram, gram, rtol=1e-12, atol=1e-18)
            np.testing.assert_allclose(model.moment, moment, rtol=1e-12, atol=1e-18)
            n = 0
    assert len(model._rows) == n > 0 and model.num_updates == 3 * stm.SOLVE_EVERY + 5


def test_overlap_commits_see_launch_step_indices(tiny_model_dir, spec_args, monkeypatch):
    """With overlap scheduling a commit comes after the next step's launch (pipelined) or
    before it (drained); the controller gets each step's launch index, so one request's decode
    steps are consecutive across pipelined and drained steps."""
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
        speculative_adaptive_config=json.dumps({"probe_every": 3}),
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


def test_nothing_can_pay_bound_is_safe_and_used_under_load():
    """The early exit (no allocation can beat all zeros) never fires where brute force finds a
    drafting allocation that beats zeros, and it does fire under heavy load (batch 256), where
    it saves scoring the two token orders."""
    rng = np.random.default_rng(7)
    fired = 0
    for _ in range(300):
        n = 3
        coef = {
            f: float(rng.uniform(0, 1)) * s
            for f, s in zip(FEATURES, [4e-3, 5e-5, 2e-4, 3e-5, 1e-3, 2e-3, 1e-8, 2e-3], strict=True)
        }
        model = StepTimeModel(coef, online=False)
        v = view(
            rng.uniform(0.05, 0.99, size=(n, K)),
            caps=rng.integers(0, K + 1, size=n),
            pending=rng.integers(0, 6, size=n),
        )
        rows, js = np.nonzero(np.arange(K)[None, :] < v.caps[:, None])
        if len(rows) == 0:
            continue
        g = np.cumprod(v.alphas, axis=1)[rows, js]
        if not GoodputPolicy._nothing_can_pay(v, model.predict, g, rows, js):
            continue
        fired += 1
        zero = GoodputPolicy.rate(v, np.zeros(n, dtype=np.int64), model.predict)
        best = max(
            GoodputPolicy.rate(v, np.array(c), model.predict)
            for c in itertools.product(*[range(c + 1) for c in v.caps])
        )
        assert best <= zero * (1 + 1e-9)
    assert fired > 30
    big = view([0.8] * 256)
    rows, js = np.nonzero(np.ones((256, K), dtype=bool))
    g = np.cumprod(big.alphas, axis=1)[rows, js]
    assert GoodputPolicy._nothing_can_pay(big, HEAVY.predict, g, rows, js)


def test_bound_model_only_rules_drafting_out():
    """choose(view, time_fn, bound_fn): the bound check reads bound_fn, every allocation that
    may draft is scored with time_fn. A bound under which nothing pays gives zeros even where
    time_fn would draft; a bound that lets drafting through gives time_fn's own choice."""
    never = synthetic(const=1e-3, verify_tokens=1e-4, spec_on=1.0)  # drafting never pays
    for alphas in ([0.9], [0.8] * 4, [0.95, 0.3, 0.9, 0.5]):
        v = view(alphas)
        drafts = GoodputPolicy().choose(v, LIGHT.predict)
        assert drafts.sum() > 0
        assert GoodputPolicy().choose(v, LIGHT.predict, never.predict).tolist() == [0] * len(alphas)
        cheap = synthetic(const=1.0, verify_tokens=1e-9)  # drafting always passes the bound
        assert GoodputPolicy().choose(v, LIGHT.predict, cheap.predict).tolist() == drafts.tolist()
    # hysteresis against a previous drafting choice is scored with time_fn, not the bound
    v = view([0.9], prev=[K])
    assert GoodputPolicy().choose(v, LIGHT.predict, never.predict).tolist() == [K]


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


def test_amortized_pending_formula():
    """K + 1 positions in full, the rest spread over min(steps left, horizon) steps (>= 1);
    steps left = tokens left over a drafting step's expected tokens at the request's cap."""
    from sglang.srt.speculative.adaptive.policy import amortized_pending, drafting_steps_left

    alphas = np.array([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
    # cap 1: 1.5 tokens per step; cap 4: 1 + .5 + .25 + .125 + .0625 = 1.9375
    np.testing.assert_allclose(
        drafting_steps_left(np.array([3, 31]), alphas, np.array([1, 4])), [2.0, 16.0]
    )

    got = amortized_pending(
        np.array([3, 40, 40, 1000, 40]), np.array([100, 100, 4, 0, 100]), steady=6, horizon=16
    )
    np.testing.assert_allclose(got, [3.0, 6 + 34 / 16, 6 + 34 / 4, 6 + 994, 6 + 34 / 16])
    np.testing.assert_allclose(amortized_pending(np.array([40]), np.array([100]), 6, 1), [40.0])


def test_long_catch_up_is_spread_over_the_remaining_steps():
    """A request lagging its draft by 500 positions (a prompt whose draft extend was deferred
    while speculation was off) drafts under a light load once its catch-up is charged 1/16
    per step; charged to one step (catchup_horizon 1), or with two tokens left (less than one
    drafting step's expected tokens), the 500-token draft extend makes drafting lose. The
    step-time model's features of an observed drafting step still count every position
    (observe), so what it learns is the real cost."""
    from sglang.srt.speculative.adaptive.controller import AdaptiveController

    # 10 ms per step, 0.1 ms per draft-model token: 500 positions cost 50 ms in one step
    model = synthetic(const=1e-2, verify_tokens=1e-4, draft_tokens=1e-4, spec_on=3e-4)
    lagging = pending_req(0, kv_len=510)
    lagging.draft.draft_kv_len = 10

    def choose(horizon: int, remaining: int) -> int:
        cfg = parse_adaptive_config(json.dumps({"catchup_horizon": horizon, "guard": False}))
        ctl = AdaptiveController(cfg, K, num_slots=2)
        ctl.time_model = model
        return ctl.choose([lagging], [K], [remaining])[0]

    assert choose(16, 200) == K
    assert choose(1, 200) == 0
    assert choose(16, 2) == 0
    # a request one position behind drafts either way: the horizon only moves long lags
    cfg = parse_adaptive_config(json.dumps({"catchup_horizon": 1, "guard": False}))
    ctl = AdaptiveController(cfg, K, num_slots=2)
    ctl.time_model = model
    assert ctl.choose([pending_req(1)], [K])[0] == K
    x = allocation_features([K], [500], 510)
    assert x[FEATURES.index("draft_tokens")] == 500 + K - 1


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
