"""--speculative-coupled-sampling edge cases (review): mixed greedy / sampled batches, logprobs and
top_logprobs of committed tokens, min_new_tokens + stop_token_ids, frequency / presence
penalties, max_draft_tokens 0 and 1 rows mixed with drafting rows, and an oracle that is always
right (every draft accepted, the bonus token committed). Each must commit what plain sampling
commits, with the same logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.managers.io_struct import BatchStrOut, TokenizedGenerateReqInput
from sglang.srt.managers.request_validation import build_sampling_params
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
from sglang.test.oracle_draft import install_oracle_pick
from sglang.test.scheduler_utils import make_scheduler

N = 6


def _params(i: int, stops: list[int]) -> dict:
    return [
        {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True},  # greedy, mixed in
        {"temperature": 1.0, "max_new_tokens": 18, "ignore_eos": True},  # logprobs + top 3
        {  # min_new_tokens masks the stop ids for 8 tokens, then they may stop it
            "temperature": 1.3,
            "max_new_tokens": 30,
            "min_new_tokens": 8,
            "stop_token_ids": stops,
        },
        {  # penalties that read the drafts; never drafts
            "temperature": 0.9,
            "max_new_tokens": 16,
            "frequency_penalty": 0.7,
            "presence_penalty": 0.4,
            "ignore_eos": True,
            "max_draft_tokens": 0,
        },
        {  # one draft at most; top-k and min-p
            "temperature": 1.1,
            "max_new_tokens": 17,
            "top_k": 20,
            "min_p": 0.05,
            "ignore_eos": True,
            "max_draft_tokens": 1,
        },
        {  # repetition penalty with logprobs
            "temperature": 0.8,
            "max_new_tokens": 19,
            "repetition_penalty": 1.3,
            "ignore_eos": True,
        },
    ][i]


def _run(model_dir: str, stops: list[int], **kw) -> tuple[dict, dict]:
    rng = random.Random(1)
    sched = make_scheduler(model_dir, **kw)
    for i in range(N):
        ids = [rng.randrange(100, 4000) for _ in range(6 + 3 * i)]
        sp = build_sampling_params(_params(i, stops), sched.tokenizer, sched.model_config)
        lp = i in (1, 5)
        sched.handle_message(
            TokenizedGenerateReqInput(
                f"r{i}", None, ids, sp, lp, -1, 3 if i == 1 else 0, False, 2000 + i
            )
        )
    outs: dict = {}

    def collect():
        for msg in sched.outputs.local_outbox:
            if not isinstance(msg, BatchStrOut):
                continue
            for j, rid in enumerate(msg.rids):
                o = outs.setdefault(rid, {"ids": [], "lps": [], "tops": [], "finish": None})
                o["ids"].extend(msg.output_ids_delta[j])
                o["lps"].extend(msg.output_token_logprobs_delta[j] or [])
                o["tops"].extend(msg.output_top_logprobs_delta[j] or [])
                if msg.spec:
                    o["spec"] = msg.spec[j]
                if msg.finished_reason[j] is not None:
                    o["finish"] = msg.finished_reason[j]
        sched.outputs.local_outbox.clear()

    for _ in range(10000):
        if sched.is_idle():
            break
        sched.step()
        collect()
    collect()
    return outs, sched.internal_state()


@pytest.fixture(scope="module")
def stops(tiny_model_dir) -> list[int]:
    # stop ids: tokens that an unconstrained run of r2 samples early
    outs, _ = _run(tiny_model_dir, [])
    return sorted(set(outs["r2"]["ids"][:6]))


@pytest.fixture(scope="module")
def plain(tiny_model_dir, stops) -> dict:
    outs, _ = _run(tiny_model_dir, stops)
    return outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("wrong_every", [3, None])
def test_coupled_edges_commit_plain(
    tiny_model_dir, draft_dir, plain, stops, monkeypatch, overlap, wrong_every
):
    by_seed = {2000 + i: plain[f"r{i}"]["ids"] for i in range(N)}
    install_oracle_pick(monkeypatch, by_seed, wrong_every)
    outs, state = _run(
        tiny_model_dir,
        stops,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=3,
        speculative_coupled_sampling=True,
        disable_overlap_schedule=not overlap,
    )
    assert plain["r2"]["finish"]["type"] == "stop", plain["r2"]["finish"]  # the case is exercised
    for i in range(N):
        p, s = plain[f"r{i}"], outs[f"r{i}"]
        assert s["ids"] == p["ids"], i
        assert s["finish"] == p["finish"], i
        assert len(s["lps"]) == len(p["lps"]), i
        for (a, ta), (b, tb) in zip(s["lps"], p["lps"], strict=True):
            assert ta == tb and a == pytest.approx(b, abs=1e-4), i
        assert len(s["tops"]) == len(p["tops"]), i
        for x, y in zip(s["tops"], p["tops"], strict=True):
            x, y = x or [], y or []  # None and [] both: no top logprobs asked
            assert [t for _, t in x] == [t for _, t in y], i
            assert [v for v, _ in x] == pytest.approx([v for v, _ in y], abs=1e-4), i
    assert state["spec_accepted_drafts"] > 0
    if wrong_every is None:  # every proposal right: all accepted (bonus tokens committed)
        for i in (0, 1, 4, 5):  # (r2 stops early: its drafts past the stop are wrong)
            _, correct, proposed, _ = outs[f"r{i}"]["spec"]
            assert 0 < correct == proposed, (i, correct, proposed)
        assert outs["r3"]["spec"][2] == 0  # max_draft_tokens 0: never drafted
    assert state["num_used_tokens"] == 0


def test_coupled_draft_race_uses_target_vocab_noise():
    """With a draft vocabulary (EAGLE-3's d2t), the coupled draft must run the plain sampler's
    race over target ids: the noise of a column is keyed by its index, and the target race
    indexes by target id. A draft whose distribution equals the target's must then propose
    exactly the token the target's race picks (else coupling accepts only by chance)."""
    from types import SimpleNamespace

    from sglang.srt.sampling.random import STREAM_SAMPLE, sample_from_probs

    torch.manual_seed(0)
    V, Vd, m = 64, 16, 256
    d2t = torch.sort(torch.randperm(V)[:Vd]).values  # draft id -> target id
    worker = SimpleNamespace(vocab_size=V, draft_to_target=d2t, device=torch.device("cpu"))
    worker.coupled = True
    logits = torch.randn(m, Vd) * 2
    info = SimpleNamespace(
        is_all_greedy=False,
        greedy_mask=torch.zeros(m, dtype=torch.bool),
        temperatures=torch.full((m, 1), 0.8),
        random_positions=torch.arange(m, dtype=torch.int64) % 7,
        seeds=torch.arange(m, dtype=torch.int64) * 1013,
    )
    active = list(range(m))
    q_rows = [[] for _ in active]
    tok = EAGLEWorkerV2._pick(worker, logits, active, 1, info, q_rows)
    p = torch.zeros(m, V)
    p[:, d2t] = torch.softmax(logits / 0.8, dim=-1)  # the target's distribution = the draft's
    target = sample_from_probs(p, info.seeds, info.random_positions, STREAM_SAMPLE)
    assert (tok == target).float().mean().item() == 1.0


@pytest.mark.parametrize("draft_vocab", [None, 2048])
def test_coupled_real_draft_commits_plain(tiny_model_dir, plain, stops, tmp_path, draft_vocab):
    """The real _pick (the oracle tests replace it), with and without a draft vocabulary."""
    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

    d = make_tiny_eagle3_dir(str(tmp_path), tiny_model_dir, draft_vocab_size=draft_vocab)
    outs, state = _run(
        tiny_model_dir,
        stops,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=d,
        speculative_num_steps=3,
        speculative_coupled_sampling=True,
    )
    for i in range(N):
        assert outs[f"r{i}"]["ids"] == plain[f"r{i}"]["ids"], i
    assert state["spec_proposed_drafts"] > 0 and state["num_used_tokens"] == 0
