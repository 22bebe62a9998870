"""Each point's scheduler host time split into prefill and decode steps, from a paired_serving.py
result (its servers' cumulative counters, read before and after every point):

    python benchmark/host_phase_deltas.py benchmark/results/paired_smollm2_h200_s36.json \
        [--concurrency 2 8] [--phases launch plan commit] [--excess-over no_spec]

Why: a point's `host_us_per_step` averages every forward step, and `<phase>_extend` (the part
spent on prefill steps) is averaged over all steps too, so a server that runs fewer, larger
prefill steps and one whose every prefill step costs more look alike. Here, per point and
phase: ms per prefill step (host_s_<phase>_extend / prefill steps) and us per decode step
((host_s_<phase> - host_s_<phase>_extend) / decode steps), with the point's prefill steps,
requests per prefill step and forward steps, and, from servers that report them
(ForwardCounters), how many prefill steps the target replayed through a graph or ran eagerly
and the host ms per prefill step of each, and, per decode step, the us of the launch's parts
(the target's forward, the worker's whole launch, the future ids). A point's counters are
the differences between its server_state and the previous point's of the same server
instance (paired_serving.py records the state after each point; the first point of an
instance is taken from the server's start, so it includes the warm-up requests' steps).
"""

from __future__ import annotations

import argparse
import json
import sys

COUNTERS = ("forward_steps", "prefill_steps", "prefill_reqs")


def delta(before: dict, after: dict, name: str) -> float:
    """A cumulative counter's growth between two states (0 where `before` lacks it)."""
    return after.get(name, 0) - before.get(name, 0)


def step_kind_seconds(
    before: dict, after: dict, phases: tuple[str, ...]
) -> tuple[int, int, dict[str, tuple[float, float]]]:
    """Between two cumulative scheduler states (the keys of HostPhases.info(),
    `host_s_<phase>` and `host_s_<phase>_extend`, with `prefill_steps` and `forward_steps`;
    a server's server_state has them; a key missing from `before` counts as 0): (prefill
    steps, decode steps, {phase: (seconds on prefill steps, seconds on decode steps)})."""

    prefills = int(delta(before, after, "prefill_steps"))
    decodes = int(delta(before, after, "forward_steps")) - prefills
    seconds = {}
    for ph in phases:
        ext = delta(before, after, f"host_s_{ph}_extend")
        seconds[ph] = (ext, delta(before, after, f"host_s_{ph}") - ext)
    return prefills, decodes, seconds


def runner_deltas(before: dict, after: dict, decode_steps: int) -> dict:
    """The target runner's forwards between two states (ForwardCounters.info() keys, from
    servers of the thirty-ninth session on; {} when `after` lacks them): prefill steps replayed
    through a graph and run eagerly, ms of host time per prefill step of each path (None
    without such a step), and `runner_us_per_decode`, us of the target's forwards per decode
    step (None without one), which `launch_us_per_decode` contains."""
    if "runner_prefill_graph_steps" not in after:
        return {}
    out = {}
    for path in ("graph", "eager"):
        name = f"runner_prefill_{path}"
        n = int(delta(before, after, f"{name}_steps"))
        s = delta(before, after, f"{name}_s")
        out[f"prefill_{path}"] = n
        out[f"fwd_ms_prefill_{path}"] = round(1e3 * s / n, 3) if n else None
    runner = sum(delta(before, after, f"runner_decode_{p}_s") for p in ("graph", "eager"))
    out["runner_us_per_decode"] = round(1e6 * runner / decode_steps, 1) if decode_steps else None
    return out


def launch_deltas(before: dict, after: dict, decode_steps: int) -> dict:
    """Per decode step, us of host time of the launch's parts (TpModelWorkerClient.launch_info
    keys, from servers of the thirty-ninth session on; {} when `after` lacks them or no decode
    step ran): `worker_us_per_decode` (the worker's whole launch: forward, sampling, read-back
    copy) and `future_us_per_decode` (resolving future ids and writing the sampled ones)."""
    if "launch_s_worker" not in after or decode_steps <= 0:
        return {}

    def decode_s(name: str) -> float:
        return delta(before, after, name) - delta(before, after, f"{name}_extend")

    future = decode_s("launch_s_future_ids") + decode_s("launch_s_future_write")
    return {
        "worker_us_per_decode": round(1e6 * decode_s("launch_s_worker") / decode_steps, 1),
        "future_us_per_decode": round(1e6 * future / decode_steps, 1),
    }


def point_deltas(points: list[dict], phases: tuple[str, ...]) -> list[dict]:
    """One row per point that has a server_state: (config, instance, round, concurrency), the
    counter differences (COUNTERS) and, per phase, ms per prefill step and us per decode step
    (None where the point had no step of that kind). Points are taken in their run order
    (as listed), each against the previous one of the same configuration and instance."""
    prev: dict[tuple, dict] = {}
    rows = []
    for p in points:
        state = p.get("server_state")
        if not state or "forward_steps" not in state:
            continue
        key = (p["config"], p.get("instance", 0))
        before = prev.get(key, {})
        prev[key] = state

        d = {c: int(delta(before, state, c)) for c in COUNTERS}
        prefill_steps, decode_steps, seconds = step_kind_seconds(before, state, phases)
        row = {
            "config": p["config"],
            "instance": p.get("instance", 0),
            "round": p.get("round"),
            "concurrency": p["concurrency"],
            **d,
            "output_tok_s": p.get("output_throughput"),
        }
        row.update(runner_deltas(before, state, decode_steps))
        row.update(launch_deltas(before, state, decode_steps))
        for ph, (ext, rest) in seconds.items():
            row[f"{ph}_ms_per_prefill"] = (
                round(1e3 * ext / prefill_steps, 3) if prefill_steps > 0 else None
            )
            row[f"{ph}_us_per_decode"] = (
                round(1e6 * rest / decode_steps, 1) if decode_steps > 0 else None
            )
        rows.append(row)
    return rows


def excess_over(rows: list[dict], base: str, phases: tuple[str, ...]) -> list[dict]:
    """Each other configuration's per-phase figures minus `base`'s in the same round and
    concurrency (rows of point_deltas), for the points both have: `<phase>_ms_per_prefill`
    and `<phase>_us_per_decode` differences (None where either is None). Raises ValueError
    when no row has config `base`."""
    by_key = {(r["round"], r["concurrency"]): r for r in rows if r["config"] == base}
    if not by_key:
        raise ValueError(f"no point of configuration {base!r}")
    out = []
    for r in rows:
        b = by_key.get((r["round"], r["concurrency"]))
        if r["config"] == base or b is None:
            continue
        d = {k: r[k] for k in ("config", "instance", "round", "concurrency")}
        for ph in phases:
            for kind in ("ms_per_prefill", "us_per_decode"):
                k = f"{ph}_{kind}"
                d[k] = None if r[k] is None or b[k] is None else round(r[k] - b[k], 3)
        out.append(d)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result_file", help="a paired_serving.py result JSON")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: all")
    p.add_argument("--phases", nargs="+", default=["launch", "plan", "commit"])
    p.add_argument(
        "--excess-over",
        default=None,
        metavar="CONFIG",
        help="print each other configuration's figures minus CONFIG's in the same round and "
        "concurrency instead",
    )
    a = p.parse_args(argv)
    extend_phases = ("plan", "build", "launch", "commit")  # host_phases.EXTEND_PHASES
    bad = [ph for ph in a.phases if ph not in extend_phases]
    if bad:
        p.error(f"--phases: {bad} have no prefill part; choose from {list(extend_phases)}")
    try:
        with open(a.result_file) as f:
            points = json.load(f)["points"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"{a.result_file}: not a paired_serving.py result ({type(e).__name__}: {e})")
    rows = point_deltas(points, tuple(a.phases))
    if a.concurrency:
        rows = [r for r in rows if r["concurrency"] in a.concurrency]
    cols = ["concurrency", "config", "instance", "round", "forward_steps", "prefill_steps"]
    cols += ["prefill_reqs"]
    runner_cols = ["prefill_graph", "prefill_eager", "fwd_ms_prefill_graph"]
    runner_cols += ["fwd_ms_prefill_eager", "runner_us_per_decode"]
    if a.excess_over is None and any("prefill_graph" in r for r in rows):
        cols += runner_cols
    launch_cols = ["worker_us_per_decode", "future_us_per_decode"]
    if a.excess_over is None and any("worker_us_per_decode" in r for r in rows):
        cols += launch_cols
    if a.excess_over is not None:
        try:
            rows = excess_over(rows, a.excess_over, tuple(a.phases))
        except ValueError as e:
            p.error(f"--excess-over: {e}")
        cols = cols[:4]
    for ph in a.phases:
        cols += [f"{ph}_ms_per_prefill", f"{ph}_us_per_decode"]
    print("\t".join(cols))
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["config"], r["round"])):
        print("\t".join("-" if r.get(c) is None else str(r[c]) for c in cols))
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
