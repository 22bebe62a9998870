"""Host (CPU) work of the scheduler per decode step, without the model: what a GPU step
would wait on. Runs the in-process Scheduler on a tiny random model (its forward is cheap) for
`--batch-size` requests x `--output-len` tokens and reports, per decode step, the wall time of
the scheduler's own phases, measured with cProfile's cumulative times:

    python benchmark/profile_scheduler_host.py --batch-size 256 --output-len 32 \
        --result-file benchmark/results/scheduler_host_cpu.json

Phases: plan (BatchBuilder.get_next_batch_to_run), build (build_model_worker_batch), commit
(OutputProcessor.process_batch_result: token commit, stop checks, KV release). The forward and
sampling are excluded (they are the device's work on a GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import tempfile

from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit
from sglang.test.tiny_models import make_tiny_model_dir

PHASES = {
    "plan": "get_next_batch_to_run",
    "build": "build_model_worker_batch",
    "commit": "process_batch_result",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--input-len", type=int, default=30)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--result-file", default=None)
    a = p.parse_args()
    model = make_tiny_model_dir(tempfile.mkdtemp(prefix="tiny_prof_"))
    sched = make_scheduler(
        model, device="cpu", dtype="float32", max_total_tokens=a.max_total_tokens
    )
    params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    for i in range(a.batch_size):
        submit(sched, f"r{i}", list(range(10, 10 + a.input_len)), params)
    outs: dict = {}
    sched.step()  # prefill, not profiled
    prof = cProfile.Profile()
    prof.enable()
    run_until_idle(sched, outs)
    prof.disable()
    steps = sched.stats["forward_steps"] - 1
    stats = pstats.Stats(prof).stats
    per_step_ms = {}
    for phase, fn in PHASES.items():
        cum = sum(v[3] for k, v in stats.items() if k[2] == fn)
        per_step_ms[phase] = 1e3 * cum / max(1, steps)
    per_step_ms["total"] = sum(per_step_ms.values())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python benchmark/profile_scheduler_host.py "
        f"--batch-size {a.batch_size} --output-len {a.output_len}",
        "git_commit": commit,
        "decode_steps": steps,
        "host_ms_per_step_under_cprofile": per_step_ms,
    }
    print(json.dumps(result, indent=1))
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
