"""The adaptive controller over closed-loop serving rounds on a simulated clock (no model, no
GPU): drafting request-steps and output tokens/s per round, for a few --speculative-adaptive-config
variants.

    python benchmark/simulate_adaptive_rounds.py [--rounds 12] [--num-reqs 128] \
        [--result-file benchmark/results/simulate_adaptive_rounds_cpu.json]

Why: on the H200 at c = 16 (twenty-sixth session) the adaptive SmolLM2 server drafted again
in every round of a paired run, each drafting step taking 2-3x what its step-time model
predicted, because the model forgot within ~150 plain steps what drafting cost. The rounds
here (sglang.test.adaptive_sim.simulate_rounds) use the costs measured there and the
twentieth session's warm-up prior, and compare per-regime forgetting (the default), one
forgetting factor for all (time_idle_decay = time_decay = 0.98, the model before), and a
policy that never drafts.
"""

from __future__ import annotations

import argparse

from bench_common import run_meta, write_json

from sglang.test.adaptive_sim import simulate_rounds

# The warm-up fit of an adaptive server on the H200 (twentieth session): a plain step of
# 1.39 ms (synthetic steps run unpipelined) and 0.75 ms more to draft.
H200_PRIOR = {
    "const": 1.39e-3,
    "verify_tokens": 1.0e-6,
    "draft_tokens": 2.3e-6,
    "draft_steps": 3.6e-7,
    "spec_on": 7.5e-4,
    "draft_reqs": 3.5e-6,
}
CONFIGS = {
    "per_regime": {"time_model": H200_PRIOR},
    "one_factor": {"time_model": H200_PRIOR, "time_idle_decay": 0.98},
    "never": {"time_model": {"verify_tokens": 1.0}, "online_correction": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--num-reqs", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
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
    if a.result_file:
        write_json(a.result_file, result)


if __name__ == "__main__":
    main()
