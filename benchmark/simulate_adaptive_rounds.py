"""The adaptive controller over closed-loop serving rounds on a simulated clock (no model, no
GPU): drafting request-steps and output tokens/s per round, for a few --speculative-adaptive-config
variants.

    python benchmark/simulate_adaptive_rounds.py [--rounds 12] [--num-reqs 128] [--idle-sweep] \
        [--result-file benchmark/results/simulate_adaptive_rounds_cpu.json]

Why: on the H200 at c = 16 (twenty-sixth session) the adaptive SmolLM2 server drafted again
in every round of a paired run, each drafting step taking 2-3x what its step-time model
predicted, because the model forgot within ~150 plain steps what drafting cost. The rounds
here (sglang.test.adaptive_sim.simulate_rounds) use the costs measured there and the
twentieth session's warm-up prior, and compare per-regime forgetting (the default), one
forgetting factor for all (time_idle_decay = time_decay = 0.98, the model before), and a
policy that never drafts.

--idle-sweep adds, for time_idle_decay in IDLE_SWEEP, what a kept measurement costs (a review
helper's two cases): the rounds' drafting request-steps; `stall`, the predicted drafting step
over its prior-true cost 1,000 / 3,000 / 10,000 plain bs-1 steps after one drafting step
measured as a stall (clipped to 3x); `drift`, a bs-16 plain step's prediction over its true
cost 500 / 2,000 / 5,000 steps at bs 12-19 after 600 at bs 65-250 whose steps cost more per
request (1 ms + 20 us / request up to 64, 6 ms + 40 us / request above).
"""

from __future__ import annotations

import argparse

from bench_common import run_meta, write_json

from sglang.test.adaptive_sim import H200_PRIOR, burst_drift, simulate_rounds, stall_lock_in

CONFIGS = {
    "per_regime": {"time_model": H200_PRIOR},
    "one_factor": {"time_model": H200_PRIOR, "time_idle_decay": 0.98},
    "never": {"time_model": {"verify_tokens": 1.0}, "online_correction": False},
}


IDLE_SWEEP = (0.9999, 0.9995, 0.999, 0.998, 0.995, 0.98)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--num-reqs", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--idle-sweep", action="store_true")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    result = {"meta": run_meta(), "settings": vars(a), "configs": CONFIGS, "rounds": {}}
    for name, cfg in CONFIGS.items():
        rows = simulate_rounds(cfg, a.rounds, a.num_reqs, a.concurrency)
        result["rounds"][name] = rows
        drafting = [r["drafting_request_steps"] for r in rows]
        tps = [round(r["tokens"] / r["seconds"]) for r in rows]
        print(f"{name:12s} drafting request-steps per round {drafting}")
        print(f"{'':12s} output tok/s per round {tps}")
    if a.idle_sweep:
        result["idle_sweep"] = {}
        for idle in IDLE_SWEEP:
            cfg = {"time_model": H200_PRIOR, "time_idle_decay": idle}
            rows = simulate_rounds(cfg, a.rounds, a.num_reqs, a.concurrency)
            row = {
                "drafting_request_steps": [r["drafting_request_steps"] for r in rows],
                "stall": stall_lock_in(idle),
                "drift": burst_drift(idle),
            }
            result["idle_sweep"][str(idle)] = row
            print(f"time_idle_decay {idle}: {row}")
    if a.result_file:
        write_json(a.result_file, result)


if __name__ == "__main__":
    main()
