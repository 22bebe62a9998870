"""The report of a paired_serving.py run: per (concurrency, configuration) summary rows over
the rounds, the markdown table with the command that produced it, each configuration's
verdict against the goal (ratio_verdict.py) and what was not measured. paired_serving.py runs
the servers and the points; this module only reads its result dict.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from host_probe import host_adjusted_ratio, log_correlation
from ratio_verdict import verdict_markdown

# Processes whose CPU use a point records (sweep_serving._cpu_util): the benchmark client and
# the server's HTTP process and scheduler process.
CPU_ROLES = ("client", "http", "scheduler")


def summarize(points: list[dict], configs: list[str]) -> list[dict]:
    """Per (concurrency, configuration) over the rounds whose point is ok: median / min / max
    of output tok/s, medians of the points' median TTFT and ITL, and the paired ratio of
    output tok/s to configs[0] in the same round (rounds where both are ok). With an A/A twin
    of configs[0] among the configurations (named configs[0] + "_b", e.g. `--add-config
    no_spec_b=`), also each other configuration's ratio to the geometric mean of the two in
    the same round (`ratio_to_twins_*`): a baseline of two servers, so one server's luck in a
    round moves it half as much (the fourteenth and fifteenth sessions' twins differed by up
    to 16% in a median)."""
    base = configs[0]
    twin = f"{base}_b" if f"{base}_b" in configs else None
    by_key: dict[tuple[int, str], dict[int, dict]] = {}
    for p in points:
        if p.get("status") == "ok":
            by_key.setdefault((p["concurrency"], p["config"]), {})[p["round"]] = p
    out = []
    for c in sorted({p["concurrency"] for p in points}):
        for name in configs:
            runs = by_key.get((c, name), {})
            row: dict[str, Any] = {"concurrency": c, "config": name, "rounds": len(runs)}
            if runs:
                tput = [p["output_throughput"] for p in runs.values()]
                row["output_tok_s_median"] = statistics.median(tput)
                row["output_tok_s_min"], row["output_tok_s_max"] = min(tput), max(tput)
                for key in ("median_ttft_ms", "median_itl_ms"):
                    row[key] = statistics.median(p[key] for p in runs.values())
                host = [p["host_us_per_step"] for p in runs.values() if p.get("host_us_per_step")]
                for phase in host[0] if host else ():  # scheduler thread, median over rounds
                    row[f"host_us_{phase}_median"] = statistics.median(h[phase] for h in host)
                gcs = [p["gc_per_step"]["us"] for p in runs.values() if p.get("gc_per_step")]
                if gcs:  # the process's garbage collector, inside the host phases
                    row["gc_us_per_step_median"] = statistics.median(gcs)
                utils = [p["cpu_util"] for p in runs.values() if p.get("cpu_util")]
                for role in CPU_ROLES:  # cores busy, median over rounds (sweep_serving)
                    if utils:
                        row[f"cpu_{role}_median"] = statistics.median(u[role] for u in utils)
            ratios = [
                p["output_throughput"] / b["output_throughput"]
                for r, p in runs.items()
                if (b := by_key.get((c, base), {}).get(r)) and b["output_throughput"]
            ]
            if ratios and name != base:
                row["ratio_to_base_median"] = statistics.median(ratios)
                row["ratio_to_base_min"], row["ratio_to_base_max"] = min(ratios), max(ratios)
            twins = [
                p["output_throughput"] / math.sqrt(b["output_throughput"] * t["output_throughput"])
                for r, p in (runs.items() if twin is not None and name not in (base, twin) else ())
                if (b := by_key.get((c, base), {}).get(r))
                and (t := by_key.get((c, twin), {}).get(r))
                and b["output_throughput"] * t["output_throughput"] > 0
            ]
            probed = [p for p in runs.values() if p.get("host_probe_us")]
            if probed:  # host speed while the points ran (paired_serving --host-probe-cpu)
                row["host_probe_us_median"] = statistics.median(p["host_probe_us"] for p in probed)
                corr = log_correlation(
                    [p["output_throughput"] for p in probed], [p["host_probe_us"] for p in probed]
                )
                if corr is not None:  # strongly negative: the probe explains the drift
                    row["host_probe_log_corr"] = corr
            adjusted = [
                x
                for r, p in runs.items()
                if (b := by_key.get((c, base), {}).get(r))
                and (x := host_adjusted_ratio(p, b)) is not None
            ]
            if adjusted and name != base:
                row["ratio_host_adjusted_median"] = statistics.median(adjusted)
                row["ratio_host_adjusted_min"] = min(adjusted)
                row["ratio_host_adjusted_max"] = max(adjusted)
            if twins:
                row["ratio_to_twins_median"] = statistics.median(twins)
                row["ratio_to_twins_min"], row["ratio_to_twins_max"] = min(twins), max(twins)
            out.append(row)
    return out


def _tok_s(x: float) -> str:
    """Output tok/s for the table: whole numbers, three significant digits below 100 (CPU
    runs measure about 1 tok/s, which "%.0f" shows as 0 or 1)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _ratio_cell(row: dict, key: str) -> str:
    """A summary row's `<key>_median` (min-max) for the table, or - when it has none."""
    if f"{key}_median" not in row:
        return "-"
    return f"{row[key + '_median']:.3f} ({row[key + '_min']:.3f}-{row[key + '_max']:.3f})"


def failures(result: dict) -> list[str]:
    """Markdown list items for what was not measured: the run's error (an interrupt, or a
    failure after the servers started), each configuration's start-up error, each failed
    point, and the skipped points counted by reason. [] when every point ran."""
    items = []
    if result.get("error"):
        items.append(f"- run stopped: {result['error']}")
    if result.get("host_probe_error"):
        items.append(f"- host probe: {result['host_probe_error']}")
    for cfg in result.get("configs", []):
        if cfg.get("status") == "error":
            items.append(f"- {cfg['name']}: {cfg['error'].splitlines()[0][:300]}")
    skipped: dict[str, int] = {}
    for p in result.get("points", []):
        if p.get("status") == "skipped":
            skipped[p["reason"]] = skipped.get(p["reason"], 0) + 1
        elif p.get("status") != "ok":
            err = str(p.get("error", "")).splitlines()[0][:300] if p.get("error") else ""
            items.append(
                f"- c={p['concurrency']} round {p['round']} {p['config']}: {p.get('status')}"
                + (f": {err}" if err else "")
            )
    items += [f"- {n} point(s) skipped: {why}" for why, n in sorted(skipped.items())]
    return items


def markdown(result: dict) -> str:
    """The summary as a markdown table, with the command that produced it and a list of what
    was not measured (see failures)."""
    configs = result["settings"]["configs"]
    lines = [
        f"Paired serving comparison, preset {result['settings']['preset']}, "
        f"ratio to {configs[0]} (same round), {result['settings']['rounds']} rounds (ABBA)",
        "",
        "    " + result["meta"]["command"],
        "",
        "| c | config | rounds | output tok/s (median, min-max) | ratio (median, min-max) "
        "| TTFT ms | ITL ms | cores busy: client / http / scheduler "
        "| scheduler host us per step: busy / resolve (gc: of both, the garbage collector) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    twins = any("ratio_to_twins_median" in r for r in result["summary"])
    if twins:  # one more column: the ratio to both A/A twins (summarize)
        lines[4] += f" ratio to {configs[0]} and its twin (geometric mean) |"
        lines[5] += "---|"
    probed = any("host_probe_us_median" in r for r in result["summary"])
    if probed:  # host_probe.py: the host's speed in each point, and ratios per unit of it
        lines[4] += (
            " host probe us (median) | corr(log tok/s, log probe) "
            "| ratio per unit of host speed (median, min-max) |"
        )
        lines[5] += "---|---|---|"
    for r in result["summary"]:
        if not r["rounds"]:
            empty = " - |" * (6 + twins + 3 * probed)
            lines.append(f"| {r['concurrency']} | {r['config']} | 0 |{empty}")
            continue
        host = "-"
        if "host_us_resolve_median" in r:
            busy = sum(  # the prefill parts (host_us_<phase>_extend) are inside their phases
                v
                for k, v in r.items()
                if k.startswith("host_us_") and "resolve" not in k and "_extend" not in k
            )
            host = f"{busy:.0f} / {r['host_us_resolve_median']:.0f}"
            if "gc_us_per_step_median" in r:  # of which the garbage collector
                host += f" (gc {r['gc_us_per_step_median']:.0f})"
        cpu = "-"
        if f"cpu_{CPU_ROLES[0]}_median" in r:
            cpu = " / ".join(f"{r[f'cpu_{role}_median']:.2f}" for role in CPU_ROLES)
        tput = (
            f"{_tok_s(r['output_tok_s_median'])} ({_tok_s(r['output_tok_s_min'])}-"
            f"{_tok_s(r['output_tok_s_max'])})"
        )
        ratio = _ratio_cell(r, "ratio_to_base")
        line = (
            f"| {r['concurrency']} | {r['config']} | {r['rounds']} | {tput} | {ratio} "
            f"| {r['median_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} | {cpu} | {host} |"
        )
        if twins:
            line += f" {_ratio_cell(r, 'ratio_to_twins')} |"
        if probed:
            us = r.get("host_probe_us_median")
            corr = r.get("host_probe_log_corr")
            line += (
                f" {'-' if us is None else f'{us:.0f}'} | {'-' if corr is None else f'{corr:.2f}'}"
                f" | {_ratio_cell(r, 'ratio_host_adjusted')} |"
            )
        lines.append(line)
    judged = verdict_markdown(result)  # the 0.97 goal, with the noise the run itself shows
    if judged:
        lines += ["", *judged]
    missing = failures(result)
    if missing:
        lines += ["", "Not measured:", "", *missing]
    return "\n".join(lines) + "\n"
