"""benchmark/profile_policy_runs.py: policy runs per step under churn, by recheck_margin."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import profile_policy_runs  # noqa: E402


def test_margin_cuts_shrink_reruns_under_churn():
    """Batch 2, requests of 30-40 tokens topped up every step, the H200 fit and an acceptance
    prior of 0.4 (bound ratios ~0.4, where a shrink to half the batch provably cannot make
    drafting pay): with recheck_margin 0 a finished request re-runs the policy; with 0.8 the
    same request stream runs it less often, and neither drafts. (Since the thirty-eighth
    session a shrink's run keeps the reuse window, so with margin 0 it takes the place of a
    scheduled run more often than it adds one: 6 runs against 5 in these 200 steps.)"""
    out = profile_policy_runs.main(
        [
            "--batch-sizes",
            "2",
            "--margins",
            "0",
            "0.8",
            "--rounds",
            "1",
            "--steps-per-request",
            "100",
            "--output-lens",
            "30",
            "40",
            "--extra-config",
            '{"initial_accept": 0.4}',
        ]
    )
    summary = out["results"]["bs2"]["summary"]
    assert set(summary) == {"plain", "margin_0", "margin_0.8"}
    off, on = summary["margin_0"], summary["margin_0.8"]
    assert off["drafting_steps"] == [0] and on["drafting_steps"] == [0]
    # 200 steps, a request finishing every ~17 steps
    assert off["policy_runs_per_step"][0] == pytest.approx(6 / 200)
    assert on["policy_runs_per_step"][0] == pytest.approx(5 / 200)
    assert 0 < on["zero_bound_ratio"][0] <= 0.5
    assert "policy_runs_per_step" not in summary["plain"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--margins", "1.5"],
        ["--output-lens", "9", "3"],
        ["--rounds", "0"],
        ["--time-model", "{bad"],
        ["--time-model", '{"foo": 1}'],
        ["--margins", "0", "0.0"],
        ["--extra-config", "[1]"],
        ["--extra-config", '{"recheck_max": 0}'],
    ],
)
def test_bad_arguments_are_usage_errors(argv):
    """Refused before any model loads, with argparse's usage error (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        profile_policy_runs.main(argv)
    assert e.value.code == 2
