"""Function-by-function difference of two cProfile tables, per step.

    python benchmark/cprofile_diff.py BASE.prof OTHER.prof --steps 1000 [--top 40]

For the pstats files of profile_decode_step.py --cprofile --cprofile-dir (one per mode, each
over --steps scheduler steps): the functions whose own time (tottime) per step grew most from
BASE to OTHER, with calls per step and cumulative time per step on both sides, and the totals
of own time per step. Builtins are matched by name: their table keys carry the address of the
function object (`<function Event.record at 0x7f...>`), which differs between processes.

cProfile charges a Python-level call far more than the C work inside it, so the differences
rank where host time goes; the absolute microseconds are inflated (compare step_ms without
--cprofile for those).
"""

from __future__ import annotations

import argparse
import pstats
import re

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def load(path: str) -> dict[str, tuple[int, float, float]]:
    """{"file:line(function)": (calls, tottime s, cumtime s)} of a pstats file, addresses of
    builtins removed (entries that then coincide are summed)."""
    out: dict[str, tuple[int, float, float]] = {}
    for (fn, line, name), (_, calls, tt, ct, _) in pstats.Stats(path).stats.items():
        key = _ADDRESS.sub("", f"{fn}:{line}({name})")
        n0, t0, c0 = out.get(key, (0, 0.0, 0.0))
        out[key] = (n0 + calls, t0 + tt, c0 + ct)
    return out


def diff_rows(
    base: dict[str, tuple[int, float, float]],
    other: dict[str, tuple[int, float, float]],
    steps: int,
) -> list[dict]:
    """One row per function in either table, by growth of own time per step (largest first):
    {"function", "d_tottime_us", "calls" (base, other), "tottime_us", "cumtime_us"} per step.
    Raises ValueError for steps < 1."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rows = []
    for key in set(base) | set(other):
        bn, bt, bc = base.get(key, (0, 0.0, 0.0))
        on, ot, oc = other.get(key, (0, 0.0, 0.0))
        rows.append(
            {
                "function": key,
                "d_tottime_us": 1e6 * (ot - bt) / steps,
                "calls": (bn / steps, on / steps),
                "tottime_us": (1e6 * bt / steps, 1e6 * ot / steps),
                "cumtime_us": (1e6 * bc / steps, 1e6 * oc / steps),
            }
        )
    rows.sort(key=lambda r: -r["d_tottime_us"])
    return rows


def total_us(table: dict[str, tuple[int, float, float]], steps: int) -> float:
    """Own time of every function per step, microseconds: the profiled thread's busy time."""
    return 1e6 * sum(t for _, t, _ in table.values()) / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--steps", type=int, required=True, help="steps each table covers")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    base, other = load(a.base), load(a.other)
    print(
        f"own time per step: base {total_us(base, a.steps):.1f} us, "
        f"other {total_us(other, a.steps):.1f} us"
    )
    print("d_own_us  calls/step base->other  own us base->other  cum us base->other  function")
    for r in diff_rows(base, other, a.steps)[: a.top]:
        (bn, on), (bt, ot), (bc, oc) = r["calls"], r["tottime_us"], r["cumtime_us"]
        print(
            f"{r['d_tottime_us']:8.1f}  {bn:6.1f} -> {on:6.1f}  {bt:7.1f} -> {ot:7.1f}  "
            f"{bc:8.1f} -> {oc:8.1f}  {r['function'][-100:]}"
        )


if __name__ == "__main__":
    main()
