"""The fused greedy-verify kernel (layers/triton_kernels/verify.py) against verify_greedy_rows,
the torch path it replaces on CUDA, and the engine with it.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set by sglang.test.triton_interpreter before triton is imported); with CUDA it runs compiled.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang.test.triton_interpreter import DEVICE  # first: sets TRITON_INTERPRET

pytest.importorskip("triton")

from sglang.srt.layers.triton_kernels.verify import verify_greedy_fused  # noqa: E402
from sglang.srt.speculative import eagle_worker_v2  # noqa: E402
from sglang.srt.speculative.verify import (  # noqa: E402
    greedy_rows,
    packed_result,
    verify_greedy_rows,
)
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit  # noqa: E402
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir  # noqa: E402


def _batch(lens: list[int], vocab: int, gen: torch.Generator, agree: float):
    """A ragged verify batch: target argmax per row, and a verify input whose drafts copy the
    target's argmax with probability `agree` (else a random id), so accept lengths vary."""
    rows = sum(lens) + len(lens)
    predict = torch.randint(0, vocab, (rows,), generator=gen)
    ids = torch.randint(0, vocab, (rows,), generator=gen)  # last tokens: never read
    starts, s = [], 0
    for d in lens:
        starts.append(s)
        keep = torch.rand(d, generator=gen) < agree
        ids[s + 1 : s + 1 + d] = torch.where(keep, predict[s : s + d], ids[s + 1 : s + 1 + d])
        s += d + 1
    return predict, ids, starts


@pytest.mark.parametrize("seed", range(6))
def test_fused_verify_equals_the_torch_path(seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs = rng.choice([1, 3, 8, 17])
    lens = [rng.choice([0, 1, 2, 3, 5, 7]) for _ in range(bs)]
    lens[rng.randrange(bs)] = max(1, max(lens))  # a verify step drafts somewhere
    vocab = rng.choice([7, 50, 32000])  # tiny vocabularies make ties and long accepts likely
    predict, ids, starts = _batch(lens, vocab, gen, agree=rng.choice([0.0, 0.7, 1.0]))
    width = max(lens) + 1
    ref = packed_result(
        verify_greedy_rows(predict, ids, *map(torch.tensor, greedy_rows(lens)), width)
    )
    got = verify_greedy_fused(
        predict.to(DEVICE),
        ids.to(DEVICE),
        torch.tensor(starts, device=DEVICE),
        torch.tensor(lens, device=DEVICE),
        width,
    )
    assert got.dtype == torch.int64 and got.shape == (bs, width + 1)
    assert torch.equal(got.cpu(), ref)


def test_fused_verify_edges():
    # both drafts accepted; no drafts; one of two accepted (the bonus is the target's argmax
    # at the first miss)
    predict = torch.tensor([5, 6, 7, 9, 1, 2, 3])
    ids = torch.tensor([0, 5, 6, 4, 0, 1, 0])
    got = verify_greedy_fused(
        predict.to(DEVICE),
        ids.to(DEVICE),
        torch.tensor([0, 3, 4], device=DEVICE),
        torch.tensor([2, 0, 2], device=DEVICE),
        3,
    )
    assert got.tolist() == [[2, 5, 6, 7], [0, 9, -1, -1], [1, 1, 2, -1]]


def test_engine_with_the_fused_verify(tiny_model_dir, tmp_path, monkeypatch):
    """The worker's fused path (forced on: on CPU the kernel runs in the interpreter), with
    drafts of mixed lengths in one batch: the tiny random draft gives greedy outputs equal to
    the plain engine's; drafts that propose the plain continuation are all accepted (what
    the accept counts of the kernel decide)."""
    monkeypatch.setattr(eagle_worker_v2, "greedy_fused_applies", lambda device: True)
    draft = make_tiny_eagle3_dir(str(tmp_path / "e"), tiny_model_dir)
    rng = random.Random(1)
    ps = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    caps = [3, 0, 1, 2, 3, 1]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=3,
    )

    def run(kw: dict, oracle: dict | None = None):
        sched = make_scheduler(tiny_model_dir, dtype="float32", **kw)
        if oracle is not None:  # propose the plain run's continuation
            worker = sched.tp_worker

            def draft_tokens(mwb):
                by_slot = {r.req_pool_idx: r for r in sched.running}
                flat = []
                for slot, d in zip(mwb.req_pool_indices, mwb.spec.draft_lens, strict=True):
                    req = by_slot[slot]
                    n = len(req.output_ids)
                    flat += (oracle[req.rid][n : n + d] + [0] * d)[:d]
                return torch.tensor(flat, dtype=torch.int64, device=worker.device), None

            worker.draft_tokens = draft_tokens
        got: dict = {}
        for i, p in enumerate(ps):
            extra = {"max_draft_tokens": caps[i]} if kw else {}
            submit(sched, f"r{i}", p, {**params, **extra})
        run_until_idle(sched, got)
        return sched, {rid: o["output_ids"] for rid, o in got.items()}, got

    _, plain, _ = run({})
    sched, outs, _ = run(spec)
    assert outs == plain and sched.spec.stats["spec_proposed_drafts"] > 0
    sched, outs, got = run(spec, oracle=plain)
    assert outs == plain
    st = sched.spec.stats
    assert st["spec_accepted_drafts"] == st["spec_proposed_drafts"] > 0
    for i, cap in enumerate(caps):  # 11 tokens after the prefill's, cap + 1 per step
        assert got[f"r{i}"]["meta"]["spec_verify_ct"] == -(-11 // (cap + 1))
