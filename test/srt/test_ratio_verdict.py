"""benchmark/ratio_verdict.py: the bounds of a paired ratio from its rounds and from the A/A
twin's spread, the verdict against a goal, and the table paired_serving.py appends."""

from __future__ import annotations

import math
import os
import random
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))

from ratio_verdict import (  # noqa: E402
    instance_spread,
    ratio_interval,
    rounds_to_decide,
    t95,
    verdict,
    verdict_markdown,
    verdicts,
    widest,
    with_instance_spread,
)


def _pt(c: int, r: int, name: str, tput: float) -> dict:
    return {
        "concurrency": c,
        "round": r,
        "config": name,
        "status": "ok",
        "output_throughput": tput,
        "median_ttft_ms": 10.0,
        "median_itl_ms": 2.0,
    }


def test_t_quantiles():
    assert t95(1) == 6.314 and t95(2) == 2.920 and t95(30) == 1.697
    assert t95(500) == 1.645
    qs = [t95(d) for d in range(1, 40)]
    assert all(a >= b for a, b in zip(qs, qs[1:], strict=False))  # shrinking with dof
    with pytest.raises(ValueError, match="degrees of freedom"):
        t95(0)


def test_interval_from_rounds_by_hand():
    # logs of 0.9, 1.0, 1.1: mean m, sample sd s (2 dof), half width t(2) s / sqrt(3)
    iv = ratio_interval([0.9, 1.0, 1.1])
    logs = [math.log(x) for x in (0.9, 1.0, 1.1)]
    m, s = statistics.fmean(logs), statistics.stdev(logs)
    half = 2.920 * s / math.sqrt(3)
    assert iv["n"] == 3 and iv["dof"] == 2
    assert iv["geomean"] == pytest.approx(math.exp(m))
    assert iv["lower"] == pytest.approx(math.exp(m - half))
    assert iv["upper"] == pytest.approx(math.exp(m + half))
    assert verdict(iv, 0.97) == "open" and verdict(iv, 0.5) == "meets"
    assert verdict(iv, 1.5) == "below"


def test_twin_rounds_are_pooled_into_the_variance():
    iv = ratio_interval([0.95, 0.97], twin_ratios=[1.0, 1.2, 0.8])
    logs, twins = [math.log(x) for x in (0.95, 0.97)], [math.log(x) for x in (1.0, 1.2, 0.8)]
    ss = sum((x - statistics.fmean(logs)) ** 2 for x in logs)
    ss += sum((x - statistics.fmean(twins)) ** 2 for x in twins)
    assert iv["dof"] == 1 + 2
    assert iv["log_sd"] == pytest.approx(math.sqrt(ss / 3))


def test_one_round_without_twin_is_open():
    iv = ratio_interval([0.5])
    assert iv["lower"] is None and verdict(iv, 0.97) == "open"
    assert rounds_to_decide(iv, 0.97) is None
    with pytest.raises(ValueError):
        ratio_interval([])
    with pytest.raises(ValueError):
        ratio_interval([1.0, 0.0])


def test_rounds_to_decide_gives_a_verdict_at_that_many_rounds():
    """Drawing that many rounds with the same mean and sd decides the verdict (the formula
    uses the t of the current dof, so the new t is smaller and the bound clears)."""
    iv = ratio_interval([0.90, 0.95, 1.00])
    assert verdict(iv, 0.99) == "open"
    n = rounds_to_decide(iv, 0.99)
    assert n is not None and n > 3
    m, s = iv["log_mean"], iv["log_sd"]
    upper = math.exp(m + t95(n - 1) * s / math.sqrt(n))
    assert upper < 0.99  # below at n rounds
    decided = ratio_interval([0.5, 0.52, 0.51])
    assert verdict(decided, 0.97) == "below" and rounds_to_decide(decided, 0.97) == 3


def test_instance_spread_covers_a_server_that_is_persistently_slow():
    """A server instance 15% slow in every round: its rounds agree, so the rounds-only bounds
    exclude the truth (1.0); the twin's spread over concurrencies (true ratio 1, geometric
    means 0.87-1.15) keeps it inside."""
    twins = [0.87, 1.15, 0.95, 1.05, 0.9, 1.1]
    spread = instance_spread(twins)
    assert spread["dof"] == 6
    assert spread["log_sd"] == pytest.approx(
        math.sqrt(statistics.fmean(math.log(t) ** 2 for t in twins))
    )
    iv = ratio_interval([0.85, 0.86, 0.84])
    assert iv["upper"] < 1.0  # rounds only: "certainly slower"
    b = with_instance_spread(iv["geomean"], spread)
    assert b["lower"] < 0.85 < 1.0 < b["upper"]
    assert instance_spread([]) is None


def test_false_below_rate_is_about_five_percent():
    """Simulated paired runs where adaptive truly equals the goal, with noise shaped like the
    twenty-first session's twin: a server-instance effect mostly per concurrency (sd 0.06,
    plus 0.03 shared by the run) and round noise (sd 0.05 per point). The instance-aware
    verdict says "below" in about 5% of the points, the rounds-only bounds far more often."""
    rng = random.Random(0)
    goal, below, below_rounds, total = 0.97, 0, 0, 0
    for _ in range(300):
        inst = {n: rng.gauss(0, 0.03) for n in ("no_spec", "no_spec_b", "adaptive")}
        pts = []
        for c in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            inst_c = {n: v + rng.gauss(0, 0.06) for n, v in inst.items()}
            for r in range(3):
                for n, true in (("no_spec", 1.0), ("no_spec_b", 1.0), ("adaptive", goal)):
                    tput = 1000 * true * math.exp(inst_c[n] + rng.gauss(0, 0.05))
                    pts.append(_pt(c, r, n, tput))
        result = {"settings": {"configs": ["no_spec", "no_spec_b", "adaptive"]}, "points": pts}
        for row in verdicts(result, goal):
            total += 1
            below += row["verdict"] == "below"
            below_rounds += row["upper"] is not None and row["upper"] < goal
    assert 0.02 < below / total < 0.09  # 0.052 with this seed
    assert below_rounds / total > 3 * below / total  # 0.24


def test_markdown_table_and_paired_serving_appends_it():
    from paired_report import markdown, summarize

    pts = []
    for c, (b, t, a) in {1: (100, 104, 97), 4: (200, 190, 120)}.items():
        for r in range(3):
            pts += [_pt(c, r, "no_spec", b + r), _pt(c, r, "no_spec_b", t + r)]
            pts.append(_pt(c, r, "adaptive", a + r))
    cfgs = ["no_spec", "no_spec_b", "adaptive"]
    result = {
        "meta": {"command": "python benchmark/paired_serving.py --preset smollm2"},
        "settings": {"preset": "smollm2", "configs": cfgs, "rounds": 3},
        "summary": summarize(pts, cfgs),
        "points": pts,
    }
    lines = verdict_markdown(result)
    assert "A/A twin's error over 2 concurrencies" in lines[0]
    rows = [x for x in lines if x.startswith("| 1 ") or x.startswith("| 4 ")]
    assert len(rows) == 2 and rows[0].split(" | ")[1] == "adaptive"
    assert rows[1].split(" | ")[-2] == "below"  # 120 / 200: far under 0.97 either way
    assert "\n".join(lines) in markdown(result)
    no_twin = {**result, "settings": {**result["settings"], "configs": ["no_spec", "adaptive"]}}
    assert "server-instance effects are not included" in verdict_markdown(no_twin)[0]
    assert verdict_markdown({**result, "points": []}) == []


def test_a_lucky_twin_does_not_narrow_the_verdict_below_the_rounds_spread():
    """The twenty-ninth session's H200 run at c = 1 (SmolLM2, CPU sets rotated): identical
    servers ranged 715-1312 tok/s between rounds, but the twin's geometric mean came out
    1.007, so the instance-aware bounds alone (0.877-0.957) said "below" while the rounds
    scatter over 0.790-1.062. The verdict uses the wider of the two: open."""
    tput = {
        "no_spec": [1007, 1178, 808, 887, 857, 933],
        "adaptive": [786, 1043, 958, 603, 966, 877],
        "no_spec_b": [1062, 1040, 830, 825, 715, 1312],
    }
    pts = [_pt(1, r, n, v) for n, vs in tput.items() for r, v in enumerate(vs)]
    result = {"settings": {"configs": ["no_spec", "adaptive", "no_spec_b"]}, "points": pts}
    (row,) = verdicts(result, 0.97)
    assert row["instance_upper"] < 0.97  # the twin's interval alone: "below"
    assert row["lower"] < 0.97 < row["upper"]  # the rounds': open
    assert row["verdict"] == "open"
    # where the twin's interval is the wider one, it still decides (a persistently slow
    # instance, test_instance_spread_covers_a_server_that_is_persistently_slow)
    b = {"lower": 0.8, "upper": 1.2}
    assert widest(b, {"lower": 0.84, "upper": 0.86}) == b
    assert widest(b, {"lower": None, "upper": None}) == b
    assert widest(b, {"lower": 0.7, "upper": 0.9}) == {"lower": 0.7, "upper": 1.2}
