"""Adaptive speculation (issue 7): the step-time model (step_time_model.py, step_time_fit.py):
online correction towards a changed model, the warm-up profile sweep and its two-stage fit,
buffered updates against the one-at-a-time reference, and learning while no policy reads the
model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sglang.srt.speculative.adaptive.step_time_fit import profile_step_time
from sglang.srt.speculative.adaptive.step_time_model import (
    FEATURES,
    StepTimeModel,
    allocation_features,
    plain_step_features,
    step_features,
)
from sglang.test.adaptive_sim import (
    H200_PRIOR,
    ZERO,
    K,
    burst_drift,
    stall_lock_in,
    synthetic,
)


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


def test_catchup_probe_tells_draft_tokens_from_verify_tokens():
    """The sweep's drafting steps have draft_tokens = verify_tokens - bs, so without its
    catch-up steps the fit cannot tell the draft model's tokens from the verify's: a step
    catching 100 requests up over 200 positions each (what a batch that decoded without
    drafting pays when it starts) is then mispredicted. With catchup_probe the fit predicts it
    within 5%, and the sweep's own steps too."""
    true = synthetic(
        const=2e-3, bs=1e-5, verify_tokens=3e-5, draft_tokens=8e-6, draft_steps=5e-4,
        spec_on=1e-3, kv_tokens=1e-9, draft_reqs=5e-5,
    )  # fmt: skip
    errors = catchup_errors(true, sweep_rel=0.05)
    assert errors[64] < 0.05 < 0.3 < errors[0]


def test_catchup_probe_with_verify_dearer_than_a_plain_request():
    """A target whose plain step does not grow with the batch (c_bs = 0: weight-bound) while
    each extra verify token costs 5 us: stage 2 fits c_verify above what stage 1 left for bs,
    so c_verify is pinned there and the other drafting columns are refitted (a review found the
    old fixed move of the excess into draft_tokens predicting the catch-up below at 2.7x).
    Plain steps stay exact; the linear model cannot hold both, so sweep steps give way (10%)."""
    true = synthetic(
        const=10e-3, bs=0.0, verify_tokens=5e-6, draft_tokens=2e-6, draft_steps=1e-3,
        spec_on=5e-4, kv_tokens=1e-9, draft_reqs=2e-5,
    )  # fmt: skip
    assert catchup_errors(true, sweep_rel=0.1)[64] < 0.05
    fit = StepTimeModel(
        profile_step_time(probe_step(true, 512), [1, 4, 16, 64, 256], range(6), 512, 1, 64)
    )
    plain = np.stack([plain_step_features(b, b * 512) for b in (1, 7, 100, 256)])
    assert fit.predict(plain) == pytest.approx(true.predict(plain), rel=1e-4)


def probe_step(true: StepTimeModel, ctx: int, calls: list | None = None, k: int = 5):
    """run_step(bs, d, catchup=1) of the warm-up sweep (K = k), timed by the model `true`."""

    def run_step(bs: int, d: int, catchup: int = 1) -> float:
        if calls is not None:
            calls.append((bs, d, catchup))
        p = catchup if d else 0
        long = [float(p > k + 1)] * bs
        return true.predict(allocation_features([d] * bs, [p] * bs, bs * ctx, long))

    return run_step


def catchup_errors(true: StepTimeModel, sweep_rel: float) -> dict[int, float]:
    """{probe: relative error of the fit's prediction of a catch-up of 100 requests x 200
    positions} for a sweep without (0) and with (64) catch-up steps, the latter at the batch
    sizes whose catch-up has at most the warm-up's PROFILE_CATCHUP_MAX_TOKENS tokens (bs 1
    to 64 of 256), checking that each fit holds the sweep's own steps within sweep_rel and
    that the probe ran 1 + repeats times per batch size it covers."""
    from sglang.srt.speculative.adaptive.warmup import PROFILE_CATCHUP_MAX_TOKENS as cap

    sizes, ctx = [1, 4, 16, 64, 256], 512
    calls: list = []
    run_step = probe_step(true, ctx, calls)
    catch_up = allocation_features([1] * 100, [200] * 100, 100 * ctx, [1.0] * 100)
    sweep = np.stack(
        [step_features(b, b * (1 + d), b * d, d, b * ctx) for b in sizes for d in range(6)]
    )
    errors = {}
    for probe in (0, 64):
        calls.clear()
        fit = StepTimeModel(profile_step_time(run_step, sizes, range(6), ctx, 1, probe, cap))
        assert sum(c[2] == 64 for c in calls) == (2 * 4 if probe else 0)  # 1 + repeats, 4 sizes
        errors[probe] = abs(fit.predict(catch_up[None, :])[0] / true.predict(catch_up) - 1)
        assert fit.predict(sweep) == pytest.approx(true.predict(sweep), rel=sweep_rel)
    return errors


def test_catchup_probe_fits_a_long_catchups_fixed_cost():
    """Shaped like the H200 check of the warm-up fit (`warmup_fit_h200_s28.json`, SmolLM2,
    K = 5): a catch-up beyond the K + 1 positions of the drafting graphs costs a fixed 1.3 ms
    (eager draft extend, then one replay per draft step) plus little per draft token. The
    sweep's probes (64 positions at bs 1 to 64) let the fit tell the two apart: catch-ups the
    probes never ran (200 positions, up to bs 128) are predicted within 5%, and the same
    catch-ups within the graphs (no long_catchup) stay as exact."""
    from sglang.srt.speculative.adaptive.warmup import PROFILE_CATCHUP_MAX_TOKENS as cap

    true = synthetic(
        const=1.1e-3, bs=4e-6, verify_tokens=2e-6, draft_tokens=7e-8, draft_steps=1e-4,
        spec_on=1.3e-3, kv_tokens=1e-9, draft_reqs=1e-6, long_catchup=1.3e-3,
    )  # fmt: skip
    sizes, ctx = [1, 4, 16, 64, 256], 512
    fit = StepTimeModel(profile_step_time(probe_step(true, ctx), sizes, range(6), ctx, 1, 64, cap))
    assert fit.coefficients()["long_catchup"] == pytest.approx(1.3e-3, rel=0.05)
    for bs, p, d in ((1, 64, 1), (16, 200, 1), (128, 200, 1), (128, 200, 5), (8, 6, 5)):
        for long in (float(p > 6), 0.0):
            x = allocation_features([d] * bs, [p] * bs, bs * ctx, [long] * bs)
            assert fit.predict(x) == pytest.approx(true.predict(x), rel=0.05)


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
    scales = [4e-3, 1e-4, 2e-4, 3e-5, 1e-3, 2e-3, 1e-8, 2e-3, 3e-3]
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


@pytest.mark.parametrize("idle_decay", [0.9999, 0.98, 0.5])
def test_buffered_updates_equal_one_at_a_time_updates(idle_decay):
    """update() buffers measurements and folds them in batches; the statistics and the solved
    coefficients equal the eager reference (every step multiplies its regime's statistics
    by decay and every other regime's by idle_decay, then adds z z^T and z y with y clipped
    to [1/3, 3] x the last solve's prediction), whether the buffer is folded by a read mid-way
    or after SOLVE_EVERY updates. With idle_decay = decay (0.98) that is one forgetting factor
    for all, the model before the twenty-sixth session."""
    from sglang.srt.speculative.adaptive import step_time_model as stm

    rng = np.random.default_rng(3)
    model = StepTimeModel({**ZERO, "const": 2e-3, "bs": 1e-5}, idle_decay=idle_decay)
    f = len(FEATURES)
    regimes: dict = {}  # regime -> [gram, moment]
    uniform = [np.zeros((f, f)), np.zeros(f)]  # the single-factor statistics
    theta = model.theta.copy()
    n = 0
    for i in range(3 * stm.SOLVE_EVERY + 5):
        bs = int(rng.choice([1, 2, 5, 16, 40]))
        drafts = rng.integers(0, 4, bs) * (rng.random() < 0.3)
        x = allocation_features([int(d) for d in drafts], [1] * bs, 300 * bs)
        y = float(rng.choice([1e-4, 3e-3, 5e-2]))  # some clipped on either side
        z = x / stm._SCALES
        pred = max(float(z @ theta), 1e-6)
        y_c = min(max(y, pred / 3), pred * 3)
        key = (int(drafts.any()), bs.bit_length())
        assert stm.regime(x) == key  # the per-row key; _fold computes it for all rows at once
        for k, (g, m) in regimes.items():
            w = model.decay if k == key else idle_decay
            regimes[k] = [g * w, m * w]
        g, m = regimes.get(key, [np.zeros((f, f)), np.zeros(f)])
        regimes[key] = [g + np.outer(z, z), m + z * y_c]
        uniform = [uniform[0] * model.decay + np.outer(z, z), uniform[1] * model.decay + z * y_c]
        n += 1
        model.update(x, y)
        if n % stm.SOLVE_EVERY == 0 or i == 10:  # a solve: by the cadence, or a read (i = 10)
            if i == 10:
                model.predict(x)
            gram = sum(g for g, _ in regimes.values())
            moment = sum(m for _, m in regimes.values())
            theta = stm._ridge_nonneg(gram, moment, model.prior, model.prior_weight)
            np.testing.assert_allclose(model.theta, theta, rtol=1e-9, atol=1e-15)
            np.testing.assert_allclose(model.gram, gram, rtol=1e-12, atol=1e-18)
            np.testing.assert_allclose(model.moment, moment, rtol=1e-12, atol=1e-18)
            if idle_decay == model.decay:
                np.testing.assert_allclose(model.gram, uniform[0], rtol=1e-12, atol=1e-18)
                np.testing.assert_allclose(model.moment, uniform[1], rtol=1e-12, atol=1e-18)
            n = 0
    assert len(regimes) >= 6  # the runs crossed drafting and plain steps of several buckets
    assert len(model._rows) == n > 0 and model.num_updates == 3 * stm.SOLVE_EVERY + 5


def test_rare_drafting_steps_are_remembered_through_long_plain_runs():
    """Under load drafting is rare: a server measures a few drafting steps (here 6 ms at bs 1,
    where the warm-up prior says 2.1 ms) and then runs 1500 plain steps at bs 16. Per-regime
    forgetting keeps what the drafting steps and the bs-1 plain steps cost; one factor for
    all (idle_decay = decay, the model before the twenty-sixth session) is back at the prior
    for both (on the H200 the adaptive server then drafted again in every round of a paired
    run at c = 16, at 2-3x the predicted step time)."""
    x_draft = allocation_features([4], [5], 300)
    x_plain1 = allocation_features([0], [1], 300)
    x_plain16 = allocation_features([0] * 16, [1] * 16, 16 * 300)
    predicted = {}
    for idle in (0.999, 0.98):
        model = StepTimeModel({**ZERO, **H200_PRIOR}, idle_decay=idle)
        assert model.predict(x_draft) == pytest.approx(2.1e-3, rel=0.05)
        for _ in range(30):
            model.update(x_plain1, 0.8e-3)
            model.update(x_draft, 6e-3)
        for _ in range(1500):
            model.update(x_plain16, 1.2e-3)
        predicted[idle] = model.predict(np.stack([x_draft, x_plain1, x_plain16]))
    draft, plain1, plain16 = predicted[0.999]
    assert draft == pytest.approx(6e-3, rel=0.1) and plain1 == pytest.approx(0.8e-3, rel=0.1)
    assert plain16 == pytest.approx(1.2e-3, rel=0.02)
    draft, plain1, plain16 = predicted[0.98]
    assert draft < 3e-3 and plain1 > 1.1e-3  # the measurements are forgotten
    assert plain16 == pytest.approx(1.2e-3, rel=0.02)


def test_a_kept_measurement_fades_within_thousands_of_steps():
    """What keeping measurements costs, bounded by time_idle_decay's default (0.999; a review
    helper's cases, benchmark/simulate_adaptive_rounds.py --idle-sweep): one drafting step
    measured as a stall (clipped to 3x) makes drafting look ~3x its cost for a while, but
    within 10,000 plain steps the prior is back (at 0.9999 it was still 2.9x); and 2,000 steps
    after a burst at bs 65-250, whose steps cost more per request than a linear fit of bs 12-19
    allows, a bs-16 plain step is predicted within 15% (1.48x at 0.9999)."""
    stall = stall_lock_in(0.999)
    assert stall[0] > 2.0 and stall[2] < 1.1
    assert stall_lock_in(0.9999)[2] > 2.0
    drift = burst_drift(0.999)
    assert drift[1] < 1.15 and burst_drift(0.9999)[1] > 1.3
