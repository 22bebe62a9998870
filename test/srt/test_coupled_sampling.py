"""--speculative-coupled-sampling: a seeded sampled request commits exactly what plain sampling
commits, whichever steps drafted (static K, or adaptive with forced switching), while drafts
are accepted; rejection sampling (the default) keeps only the distribution.

The tiny random EAGLE-3 draft agrees with the tiny target almost never, so the drafts come
from an oracle (EAGLEWorkerV2._pick patched): at each output position it proposes the token
the plain run committed there, except at every third position a wrong one, with a one-hot
draft distribution. The oracle knows the request by its sampling seed."""

from __future__ import annotations

import json
import random

import pytest

from sglang.srt.speculative.adaptive.policy import GoodputPolicy
from sglang.test.oracle_draft import install_oracle_pick
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

TEMPS = (0.7, 1.0, 0.9, 1.2)


def _params(i: int) -> dict:
    p = {"temperature": TEMPS[i], "max_new_tokens": 14 + 3 * i, "ignore_eos": True}
    if i == 1:
        p["top_p"] = 0.9
    if i == 2:
        p["repetition_penalty"] = 1.2
    return p


def _run(model_dir: str, **kw) -> tuple[dict, dict]:
    rng = random.Random(0)
    sched = make_scheduler(model_dir, **kw)
    outs: dict = {}
    for i in range(len(TEMPS)):
        ids = [rng.randrange(100, 4000) for _ in range(5 + 4 * i)]
        # the request's random stream (sampling_seed's role), also how the oracle knows it
        submit(sched, f"r{i}", ids, _params(i), seed=1000 + i)
    run_until_idle(sched, outs)
    return outs, sched.internal_state()


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory) -> str:
    return make_tiny_eagle3_dir(str(tmp_path_factory.mktemp("eagle3")), tiny_model_dir)


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> dict:
    outs, _ = _run(tiny_model_dir)
    return {1000 + i: outs[f"r{i}"]["output_ids"] for i in range(len(TEMPS))}


@pytest.fixture
def oracle(monkeypatch, plain) -> None:
    install_oracle_pick(monkeypatch, plain, wrong_every=3)


def _spec(draft_dir: str, **kw) -> dict:
    return dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=3,
        **kw,
    )


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("adaptive", [False, True])
def test_coupled_sampling_commits_plain_sampling(
    tiny_model_dir, draft_dir, plain, oracle, monkeypatch, adaptive, overlap
):
    kw = _spec(draft_dir, speculative_coupled_sampling=True)
    kw["disable_overlap_schedule"] = not overlap
    if adaptive:  # a policy that always drafts, with a probe after every drafting step
        monkeypatch.setattr(GoodputPolicy, "choose", lambda self, view, *fns: view.caps.copy())
        cfg = {"probe_every": 1, "probe_len": 2, "guard": False}
        kw.update(speculative_adaptive=True, speculative_adaptive_config=json.dumps(cfg))
    outs, state = _run(tiny_model_dir, **kw)
    for i in range(len(TEMPS)):
        assert outs[f"r{i}"]["output_ids"] == plain[1000 + i], i
    # the oracle's right proposals were accepted, its wrong ones rejected
    assert 0 < state["spec_accepted_drafts"] < state["spec_proposed_drafts"]
    if adaptive:  # drafting and plain steps alternated
        assert state["spec_zero_probes"] > 0
    assert state["num_used_tokens"] == 0


def test_rejection_sampling_keeps_only_the_distribution(tiny_model_dir, draft_dir, plain, oracle):
    """Without coupling, a right proposal is accepted with probability p(x) and a rejection
    resamples from p without x: the text leaves the plain run's (why the flag exists)."""
    outs, state = _run(tiny_model_dir, **_spec(draft_dir))
    assert state["spec_accepted_drafts"] > 0
    assert any(outs[f"r{i}"]["output_ids"] != plain[1000 + i] for i in range(len(TEMPS)))


def test_coupled_sampling_needs_speculation(tiny_model_dir):
    with pytest.raises(ValueError, match="--speculative-coupled-sampling needs"):
        make_scheduler(tiny_model_dir, speculative_coupled_sampling=True)
