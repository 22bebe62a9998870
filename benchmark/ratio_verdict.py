"""Does a paired run show a configuration meeting issue 7's ratio goal, missing it, or neither?

    python benchmark/ratio_verdict.py benchmark/results/paired_smollm2_h200_s21.json [--goal 0.97]

Why: on the H200 machine two servers of the same configuration differ by up to 0.80-1.57x in a
round (the A/A twin of paired_serving.py, twenty-first session), so a median ratio of 0.95 over
three rounds says little about a 0.97 goal. This reads each configuration's per-round ratios to
the base (paired_serving.py's points) as a sample and gives the one-sided 95% bounds of its
geometric mean, the verdict against the goal, and about how many rounds would decide it.

Two sources of noise, two intervals:

- Rounds. A point's output tok/s is its server's rate times exp(e), e independent across rounds
  with one variance for every server. `ratio_interval` takes a configuration's per-round log
  ratios to the base (pooled with the A/A twin's, `<base>_b`, when the run has one: same
  variance, more degrees of freedom; the shared base server correlates them, so the pooled
  degrees of freedom are an upper bound) and gives exp(mean +- t * sd / sqrt(n)).
- Server instances. A paired run starts each configuration's server once and measures it in
  every round, so whatever makes one server process persistently faster or slower than another
  of the same configuration (the twenty-first session's twin was 1.15x no_spec in all three
  rounds at c = 16, 1.06-1.57) does not average out over rounds: the rounds-only interval is
  too narrow. The twin measures it: its true ratio to the base is 1, so its geometric mean at
  each concurrency is one draw of the error a configuration's geometric mean has (instance and
  rounds together, at this number of rounds). `instance_spread` pools those draws over the
  run's concurrencies (sd = sqrt(mean of ln(twin)^2), as many degrees of freedom as
  concurrencies), and `with_instance_spread` gives exp(ln(geomean) +- t * sd). This treats the
  instance effect at each concurrency as a fresh draw. The twenty-first session's twin fits
  that: its log ratios over the nine concurrencies averaged -0.05 with a spread of 0.09 around
  that mean. A run-level offset shared by all concurrencies (one draw per run, which one twin
  cannot estimate) would make the bounds too narrow. In simulated runs with a true ratio equal
  to the goal (test_ratio_verdict.py), the ``below`` rate was about 5% when the per-concurrency
  part dominates, and up to 10% when the shared part does.

Verdict against a goal g, from the instance-aware interval when the run has a twin, widened to
the rounds-only one where that is wider (`widest`; else the rounds-only one, marked as such):
``meets`` when the lower bound is at least g, ``below`` when the upper bound is under g, else
``open``. ``rounds_to_decide`` (rounds-only): the rounds at
which the current mean and sd would give a verdict, ceil((t * sd / (mean - ln g))^2), with the
t of the current degrees of freedom (optimistic for small n); instance effects need more server
instances, not more rounds.

Over k concurrencies, about 0.05 k verdicts come out ``below`` by chance alone when every true
ratio is exactly the goal (one-sided 95% each), so one ``below`` among nine points is weak
evidence until another run repeats it. This is a reading aid for noisy measurements, not
upstream behaviour.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from host_probe import host_adjusted_ratio

# One-sided 95% quantiles of Student's t for 1..30 degrees of freedom (standard tables).
T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip
Z95 = 1.645  # the normal quantile, for more than 30 degrees of freedom (t(60) = 1.671)


def t95(dof: int) -> float:
    """One-sided 95% Student-t quantile. Raises ValueError for dof < 1."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    return T95[dof - 1] if dof <= len(T95) else Z95


def _ss(xs: list[float]) -> float:
    m = statistics.fmean(xs)
    return sum((x - m) ** 2 for x in xs)


def ratio_interval(ratios: list[float], twin_ratios: list[float] | None = None) -> dict:
    """Geometric mean of `ratios` (each > 0, one per round) and its one-sided 95% bounds
    (see the module docstring); twin_ratios: the A/A twin's ratios to the same base, pooled
    into the variance. Returns {"n", "dof", "geomean", "lower", "upper", "log_mean",
    "log_sd"}; bounds and sd are None when no degree of freedom is left (one round, no twin).
    Raises ValueError for an empty list or a ratio <= 0."""
    if not ratios:
        raise ValueError("no ratios")
    if min(ratios) <= 0 or (twin_ratios and min(twin_ratios) <= 0):
        raise ValueError("ratios must be > 0")
    logs = [math.log(r) for r in ratios]
    twins = [math.log(r) for r in twin_ratios or []]
    mean = statistics.fmean(logs)
    dof = len(logs) - 1 + max(0, len(twins) - 1)
    ss = _ss(logs) + (_ss(twins) if len(twins) > 1 else 0.0)
    out = {"n": len(logs), "dof": dof, "geomean": math.exp(mean), "log_mean": mean}
    if dof < 1:
        return {**out, "lower": None, "upper": None, "log_sd": None}
    sd = math.sqrt(ss / dof)
    half = t95(dof) * sd / math.sqrt(len(logs))
    return {**out, "lower": math.exp(mean - half), "upper": math.exp(mean + half), "log_sd": sd}


def verdict(interval: dict, goal: float) -> str:
    """ "meets" (lower bound >= goal), "below" (upper bound < goal) or "open"."""
    if interval["lower"] is None:
        return "open"
    if interval["lower"] >= goal:
        return "meets"
    if interval["upper"] < goal:
        return "below"
    return "open"


def rounds_to_decide(interval: dict, goal: float) -> int | None:
    """Rounds at which the current log mean and sd would give a verdict against `goal`: the
    rounds run when the verdict is already in, None without an sd or with the mean exactly at
    the goal."""
    if interval["log_sd"] is None:
        return None
    if verdict(interval, goal) != "open":
        return interval["n"]
    gap = abs(interval["log_mean"] - math.log(goal))
    if gap == 0:
        return None
    return math.ceil((t95(interval["dof"]) * interval["log_sd"] / gap) ** 2)


def instance_spread(twin_geomeans: list[float]) -> dict | None:
    """The error of a paired geometric-mean ratio from the A/A twin's geometric means (one per
    concurrency, true value 1): {"log_sd", "dof"}, or None without any. Raises ValueError for a
    ratio <= 0."""
    if not twin_geomeans:
        return None
    if min(twin_geomeans) <= 0:
        raise ValueError("ratios must be > 0")
    logs = [math.log(g) for g in twin_geomeans]
    return {"log_sd": math.sqrt(sum(x * x for x in logs) / len(logs)), "dof": len(logs)}


def with_instance_spread(geomean: float, spread: dict) -> dict:
    """One-sided 95% bounds of a configuration's geometric-mean ratio with the instance-aware
    error of `spread` (instance_spread): {"lower", "upper"}."""
    half = t95(spread["dof"]) * spread["log_sd"]
    return {"lower": geomean * math.exp(-half), "upper": geomean * math.exp(half)}


def widest(instance: dict, rounds: dict) -> dict:
    """The bounds a verdict with an A/A twin uses: the instance-aware ones widened to the
    rounds-only ones where those are wider ({"lower", "upper"}; rounds-only bounds of None
    are ignored). With few concurrencies the twin's spread is one or two draws, and a twin
    whose geometric mean happened to land near 1 gives a narrow interval while the rounds
    themselves scatter far more (H200, SmolLM2 at c = 1, twenty-ninth session: identical
    servers 715-1312 tok/s between rounds, twin geometric mean 1.007, log sd 0.007, bounds
    0.877-0.957 against rounds-only 0.790-1.062). Each interval is a one-sided 95% bound
    under its own model; the wider of the two is one under either."""
    lo, hi = instance["lower"], instance["upper"]
    if rounds.get("lower") is not None:
        lo, hi = min(lo, rounds["lower"]), max(hi, rounds["upper"])
    return {"lower": lo, "upper": hi}


def paired_ratios(
    points: list[dict], base: str, config: str, c: int, host_adjusted: bool = False
) -> list[float]:
    """Per round, config's output tok/s over base's at concurrency c (rounds where both are ok
    and base's is > 0), in round order. host_adjusted: each per unit of host speed
    (host_probe.host_adjusted_ratio; rounds where either point lacks a probe time are left
    out)."""
    by = {}
    for p in points:
        if p.get("status") == "ok" and p["concurrency"] == c:
            by[(p["config"], p["round"])] = p
    rounds = sorted({r for (name, r) in by if name == config})
    out = []
    for r in rounds:
        b, p = by.get((base, r)), by[(config, r)]
        if host_adjusted:
            x = host_adjusted_ratio(p, b) if b is not None else None
            if x is not None:
                out.append(x)
        elif b is not None and b["output_throughput"] and p["output_throughput"] > 0:
            out.append(p["output_throughput"] / b["output_throughput"])
    return out


def verdicts(result: dict, goal: float, host_adjusted: bool = False) -> list[dict]:
    """One row per (concurrency, configuration other than the base and its twin) of a
    paired_serving.py result: its rounds-only interval (ratio_interval), the instance-aware
    bounds when the run has an A/A twin (`instance_lower` / `instance_upper`,
    with_instance_spread), the verdict (`basis`: "instances" or "rounds only") and the rounds
    to decide."""
    configs = result["settings"]["configs"]
    base = configs[0]
    twin = f"{base}_b" if f"{base}_b" in configs else None
    points = result.get("points", [])
    concurrencies = sorted({p["concurrency"] for p in points})
    twin_by_c = {
        c: paired_ratios(points, base, twin, c, host_adjusted) if twin else []
        for c in concurrencies
    }
    spread = instance_spread([statistics.geometric_mean(r) for r in twin_by_c.values() if r])
    rows = []
    for c in concurrencies:
        for name in configs:
            if name in (base, twin):
                continue
            ratios = paired_ratios(points, base, name, c, host_adjusted)
            if not ratios:
                continue
            iv = ratio_interval(ratios, twin_by_c[c])
            row = {"concurrency": c, "config": name, **iv, "goal": goal}
            judged = iv
            row["basis"] = "rounds only"
            if spread is not None:
                bounds = with_instance_spread(iv["geomean"], spread)
                row["instance_lower"], row["instance_upper"] = bounds["lower"], bounds["upper"]
                row["instance_log_sd"], row["instance_dof"] = spread["log_sd"], spread["dof"]
                judged, row["basis"] = widest(bounds, iv), "instances"
            row["verdict"] = verdict(judged, goal)
            row["rounds_to_decide"] = rounds_to_decide(iv, goal)
            rows.append(row)
    return rows


def _bound(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def verdict_markdown(result: dict, goal: float = 0.97) -> list[str]:
    """Markdown lines: a table of verdicts() against `goal` ([] when there is nothing to judge)."""
    lines = _verdict_table(result, goal, False)
    if lines and any(p.get("host_probe_us") for p in result.get("points", [])):
        lines += ["", *_verdict_table(result, goal, True)]
    return lines


def _verdict_table(result: dict, goal: float, host_adjusted: bool) -> list[str]:
    rows = verdicts(result, goal, host_adjusted)
    if not rows:
        return []
    base = result["settings"]["configs"][0]
    inst = "instance_lower" in rows[0]
    what = "ratio to"
    if host_adjusted:
        what = (
            "per unit of host speed (host_probe.py: for points where the scheduler's core is "
            "busy throughout), ratio to"
        )
    lines = [
        f"Against the {goal} goal ({what} {base}, geometric mean of the rounds, one-sided 95% "
        "bounds; benchmark/ratio_verdict.py). Rounds only: the rounds' spread"
        + (
            f"; with instances: the A/A twin's error over {rows[0]['instance_dof']} "
            f"concurrencies (log sd {rows[0]['instance_log_sd']:.3f}); the verdict uses the "
            "wider of the two intervals:"
            if inst
            else " (no A/A twin in this run: server-instance effects are not included):"
        ),
        "",
        "| c | config | rounds | geometric mean | rounds only: lower - upper "
        + ("| with instances: lower - upper " if inst else "")
        + "| verdict | rounds to decide (rounds only) |",
        "|---|---|---|---|---|" + ("---|" if inst else "") + "---|---|",
    ]
    for r in rows:
        need = "-" if r["rounds_to_decide"] is None else str(r["rounds_to_decide"])
        cells = [
            str(r["concurrency"]),
            r["config"],
            str(r["n"]),
            f"{r['geomean']:.3f}",
            f"{_bound(r['lower'])} - {_bound(r['upper'])}",
        ]
        if inst:
            cells.append(f"{_bound(r['instance_lower'])} - {_bound(r['instance_upper'])}")
        cells += [r["verdict"], need]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result_files", nargs="+", help="paired_serving.py result JSON files")
    p.add_argument("--goal", type=float, default=0.97)
    a = p.parse_args()
    for path in a.result_files:
        with open(path) as f:
            result = json.load(f)
        print(f"## {path}\n")
        print("\n".join(verdict_markdown(result, a.goal)) + "\n")


if __name__ == "__main__":
    main()
