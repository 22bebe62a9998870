"""How well the adaptive controller's warm-up fit predicts real synthetic steps, catch-ups
included (issue 7; the catch-up steps the sweep gained in the twenty-seventh session):

    python benchmark/check_warmup_fit.py --result-file benchmark/results/warmup_fit_h200.json

Builds the in-process Scheduler of an EAGLE-3 --speculative-adaptive server (the bundled
SmolLM2 and its draft by default; K = --speculative-num-steps), which on CUDA runs the warm-up
sweep at start-up (on CPU it is run here explicitly, over --cpu-batch-sizes), then times
synthetic steps (warmup.make_synthetic_step: one warm-up, the median of --repeats) for every
--batch-sizes x --catchups x d in {1, K} and compares each with the fitted model's prediction
(StepTimeModel.predict of allocation_features). Reports the fitted coefficients, the sweep's
wall time and per step measured ms, predicted ms and their ratio. Before the catch-up steps the
H200 fit set draft_tokens to 0.0, and a catch-up of 100 requests was predicted at 6.1 ms
against 22.9 ms measured in serving (benchmark/README.md, twenty-seventh session).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_common import run_meta, write_json


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--draft-model-path", default=None, help="default: the bundled draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--speculative-num-steps", type=int, default=5)
    p.add_argument("--context-len", type=int, default=512, help="of every synthetic request")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--catchups", type=int, nargs="+", default=[1, 64, 200])
    p.add_argument("--cpu-batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-total-tokens", type=int, default=200000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)

    from sglang.srt.server_args_resolve import resolve_device
    from sglang.srt.speculative.adaptive.step_time_model import allocation_features
    from sglang.srt.speculative.adaptive.warmup import make_synthetic_step, profile_on_worker
    from sglang.test.scheduler_utils import make_scheduler

    device = resolve_device(args.device)
    cfg = {"profile_batch_sizes": args.cpu_batch_sizes} if device == "cpu" else {}
    t0 = time.perf_counter()
    sched = make_scheduler(
        args.model_path,
        device=device,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=args.draft_model_path,
        speculative_num_steps=args.speculative_num_steps,
        speculative_adaptive=True,
        speculative_adaptive_config=json.dumps(cfg),
        max_total_tokens=args.max_total_tokens,
        dtype=args.dtype,
    )
    a = sched.spec.adaptive
    if device == "cpu":  # the scheduler runs the sweep on CUDA only
        profile_on_worker(sched, a, context_len=args.context_len)
    startup_s = time.perf_counter() - t0
    model = a.time_model
    run_step = make_synthetic_step(sched, args.context_len)
    k = args.speculative_num_steps
    rows = []
    for bs in args.batch_sizes:
        for c in args.catchups:
            for d in sorted({1, k}):
                times = [run_step(bs, d, c) for _ in range(args.repeats + 1)][1:]
                long = [float(c > k + 1)] * bs  # beyond the drafting graphs' K + 1
                x = allocation_features([d] * bs, [c] * bs, bs * args.context_len, long)
                measured, predicted = statistics.median(times), float(model.predict(x))
                rows.append(
                    {
                        "bs": bs,
                        "catchup": c,
                        "d": d,
                        "measured_ms": round(measured * 1e3, 3),
                        "predicted_ms": round(predicted * 1e3, 3),
                        "measured_over_predicted": round(measured / predicted, 3),
                    }
                )
                print(rows[-1], flush=True)
    result = {
        "meta": run_meta(argv),
        "device": device,
        "coefficients": model.coefficients(),
        "startup_s_with_warmup": round(startup_s, 2),
        "steps": rows,
    }
    print(json.dumps({"coefficients": result["coefficients"]}, indent=1))
    if args.result_file:
        write_json(args.result_file, result)
    return result


if __name__ == "__main__":
    main()
