"""How many requests admitted while speculation is off can never draft (stale), and what the
prefill costs, on the bundled SmolLM2 + EAGLE-3 draft with its chat template (CPU, in-process):

    python benchmark/stale_prefills.py [--num-prompts 64] [--concurrency 16]

Speculation is held off (every request takes target-only cached prefixes and no step drafts,
as an adaptive server under load does), held-out ShareGPT first turns arrive closed-loop at
--concurrency, 4 output tokens each. Prints the speculative prefill counters
(`spec_deferred_draft_extends`, `spec_prefill_draft_extends`, `spec_stale_prefills`) and the
scheduler's prefill / prompt / cached token counts. Requests share the chat template and branch
where their turns differ; BatchBuilder.match_prefix's MAX_BRANCH_CUT decides whether a prefix
that crosses such a branch is cut back (recomputed tokens) or leaves the request stale.
"""

from __future__ import annotations

import argparse
import json
import os

from sglang.srt.model_loader.bundled import bundled_gguf_path
from sglang.test.scheduler_utils import collect, make_scheduler, submit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args()
    if a.num_prompts < 1 or a.concurrency < 1:  # 0 requests in flight would step forever
        p.error("--num-prompts and --concurrency must be >= 1")
    sched = make_scheduler(
        str(bundled_gguf_path()),
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=f"{REPO}/python/sglang/data/smollm2_eagle3",
        speculative_num_steps=3,
        speculative_adaptive=True,
        dtype="float32",
        max_total_tokens=40000,
    )
    spec = sched.spec
    spec.takes_target_only_prefix = lambda: True  # speculation off, as under load
    spec.choose_draft_lens = lambda reqs: [0] * len(reqs)
    with open(f"{REPO}/benchmark/data/sharegpt_bench_conversations.json") as f:
        rows = json.load(f)[: a.num_prompts]
    prompts = []
    for r in rows:
        turn = [{"role": "user", "content": r["conversations"][0]["value"]}]
        ids = sched.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"])[:400])
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    outs: dict = {}
    i = 0
    while i < len(prompts) or sched.running or sched.waiting_queue:
        while i < len(prompts) and len(sched.running) + len(sched.waiting_queue) < a.concurrency:
            submit(sched, f"r{i}", prompts[i], params)
            i += 1
        sched.step()
        collect(sched, outs)
    counts = {k: v for k, v in spec.stats.items() if "prefill" in k or "deferred" in k}
    counts.update({k: sched.stats[k] for k in ("prefill_tokens", "prompt_tokens", "cached_tokens")})
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
