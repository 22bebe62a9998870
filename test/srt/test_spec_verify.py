"""Tests for speculative verification (greedy and speculative sampling), references and batched."""

from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.layers.sampler import top_k_top_p_min_p_renorm
from sglang.srt.sampling.random import (
    STREAM_SAMPLE,
    STREAM_SPEC_ACCEPT,
    STREAM_SPEC_RESAMPLE,
    sample_from_probs,
    uniform_noise,
)
from sglang.srt.speculative.verify import (
    greedy_rows,
    speculative_sample,
    speculative_sample_reference,
    verify_greedy,
    verify_greedy_reference,
    verify_greedy_rows,
)


# --------------------------------------------------------------------------- chi-square helper
def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x): series for x < a + 1, else Lentz's
    continued fraction (Numerical Recipes 6.2)."""
    if x <= 0.0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        ap, term = a, 1.0 / a
        total = term
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_prefix) * h


def chi2_sf(stat: float, dof: int) -> float:
    """P(Chi2(dof) >= stat)."""
    return _gamma_q(dof / 2.0, stat / 2.0)


def chi2_test(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and dof of integer counts [K] against probs [K]. Cells with probability
    0 must be empty (asserted) and are left out."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum().item() == 0, "a zero-probability outcome was emitted"
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    return stat, int(keep.sum().item()) - 1


@pytest.mark.parametrize(
    "stat, dof, sf",
    [
        (3.841458820694124, 1, 0.05),
        (18.307038053275146, 10, 0.05),
        (2.0, 3, 0.5724067044708798),
        (0.5, 4, 0.9735009788392561),
        (100.0, 63, 0.002077236552784822),
        (30.0, 7, 9.495972508134177e-05),
        (0.0, 5, 1.0),
    ],
)
def test_chi2_sf_matches_known_values(stat: float, dof: int, sf: float) -> None:
    # Reference values from scipy.stats.chi2.sf.
    assert chi2_sf(stat, dof) == pytest.approx(sf, rel=1e-9, abs=1e-15)


# ---------------------------------------------------------------------------- greedy reference
@pytest.mark.parametrize(
    "draft, target, tokens, n",
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8], 3),  # all accepted + bonus
        ([5, 6, 7], [4, 6, 7, 8], [4], 0),  # first rejected
        ([5, 6, 7], [5, 9, 7, 8], [5, 9], 1),  # later ones match, but the chain broke at 1
        ([], [3], [3], 0),  # d = 0: just the target's token
    ],
)
def test_verify_greedy_reference(draft: list, target: list, tokens: list, n: int) -> None:
    assert verify_greedy_reference(draft, target) == (tokens, n)


def test_verify_greedy_reference_rejects_bad_length() -> None:
    with pytest.raises(ValueError):
        verify_greedy_reference([1, 2], [1, 2])


# ------------------------------------------------------------------------------- batch builders
def _offsets(lens: list[int], extra: int) -> list[int]:
    """Start of each request's rows when request i owns lens[i] + extra rows."""
    out, acc = [], 0
    for d in lens:
        out.append(acc)
        acc += d + extra
    return out


def _flat_reference_tokens(per_req: list[list[int]]) -> torch.Tensor:
    return torch.tensor([t for toks in per_req for t in toks], dtype=torch.int64)


# ------------------------------------------------------------------------------ batched greedy
@pytest.mark.parametrize("trial", range(6))
def test_verify_greedy_batched_matches_reference(trial: int) -> None:
    g = torch.Generator().manual_seed(trial)
    bs, vocab = 9, 5
    lens = torch.randint(0, 6, (bs,), generator=g).tolist()
    lens[trial % bs] = 0
    logits = torch.randn(sum(lens) + bs, vocab, generator=g)  # [sum (d+1), V]
    argmax = logits.argmax(-1)
    t_starts, d_starts = _offsets(lens, 1), _offsets(lens, 0)
    drafts = []
    for i, d in enumerate(lens):
        # Drafts mostly agree with the target so accept lengths cover 0 .. d.
        agree = argmax[t_starts[i] : t_starts[i] + d]
        noise = torch.randint(0, vocab, (d,), generator=g)
        drafts.append(torch.where(torch.rand(d, generator=g) < 0.25, noise, agree))
    draft_tokens = torch.cat(drafts) if drafts else torch.zeros(0, dtype=torch.int64)

    out_ids, n_acc = verify_greedy(draft_tokens, torch.tensor(lens), logits)
    out_ids2, n_acc2 = verify_greedy(draft_tokens, torch.tensor(lens, dtype=torch.int32), argmax)
    assert torch.equal(out_ids, out_ids2) and torch.equal(n_acc, n_acc2)
    # the engine's path: indices built on the host, drafts read from the verify input
    verify_ids = torch.full((sum(lens) + bs,), -7, dtype=torch.int64)  # last tokens: unread
    for i, d in enumerate(lens):
        verify_ids[t_starts[i] + 1 : t_starts[i] + 1 + d] = draft_tokens[
            d_starts[i] : d_starts[i] + d
        ]
    idx = [torch.tensor(x) for x in greedy_rows(lens)]
    rows_out = verify_greedy_rows(argmax, verify_ids, *idx, max(lens) + 1)
    assert torch.equal(rows_out.output_ids, out_ids) and torch.equal(rows_out.num_accepted, n_acc)
    assert out_ids.shape == (bs, max(lens) + 1) and out_ids.dtype == torch.int64

    ref = []
    for i, d in enumerate(lens):
        toks, n = verify_greedy_reference(
            draft_tokens[d_starts[i] : d_starts[i] + d].tolist(),
            argmax[t_starts[i] : t_starts[i] + d + 1].tolist(),
        )
        ref.append(toks)
        assert n_acc[i].item() == n
        assert out_ids[i].tolist() == toks + [-1] * (max(lens) + 1 - len(toks))
    assert torch.equal(out_ids[out_ids >= 0], _flat_reference_tokens(ref))


def test_greedy_rows_layout() -> None:
    """Requests with d = 2 and 0: W = 3 columns each; the second request starts at row 3."""
    target, draft, valid = greedy_rows([2, 0])
    assert target == [0, 1, 2, 3, 3, 3]
    assert draft == [1, 2, 2, 3, 3, 3]
    assert valid == [1, 1, 0, 0, 0, 0]
    assert greedy_rows([]) == ([], [], [])


def test_verify_greedy_all_zero_lengths_and_errors() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    out_ids, n_acc = verify_greedy(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0]), logits)
    assert out_ids.tolist() == [[1], [0]] and n_acc.tolist() == [0, 0]
    with pytest.raises(ValueError):  # 2 requests with d = 1 need 4 target rows
        verify_greedy(torch.tensor([1, 2]), torch.tensor([1, 1]), logits)
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([1]), torch.tensor([2, -1]), torch.zeros(3, dtype=torch.int64))
    # lengths given on the host (speculative_sample's engine path) are checked the same way
    p, u = torch.full((2, 3), 1 / 3), torch.full((2,), 0.5)

    def fn(probs: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return probs.argmax(-1)

    none = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="host_lens has 1 entries for 2 requests"):
        speculative_sample(none, torch.tensor([0, 0]), torch.zeros(0, 3), p, u, fn, [0])
    with pytest.raises(ValueError, match="expected 2 draft rows"):
        speculative_sample(
            torch.tensor([1]), torch.tensor([1, 1]), torch.zeros(1, 3), torch.zeros(4, 3),
            torch.full((4,), 0.5), fn, host_lens=[1, 1],
        )  # fmt: skip


# ------------------------------------------------------------------------ sampling reference
def test_speculative_sample_reference_hand_example() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])  # [d=1, V=4]
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])  # [2, 4]
    calls = []

    def fn(probs: torch.Tensor, j: int) -> int:
        calls.append((probs.tolist(), j))
        return 2

    # p(0)/q(0) = 0.5: u = 0.4 accepts, then the bonus comes from p[1].
    assert speculative_sample_reference([0], q, p, torch.tensor([0.4, 0.9]), fn) == ([0, 2], 1)
    assert calls == [([0.0, 0.0, 0.0, 1.0], 1)]
    calls.clear()
    # u = 0.6 rejects: residual norm(max(p - q, 0)) = [0, 0, .5, .5], drawn at index 0.
    assert speculative_sample_reference([0], q, p, torch.tensor([0.6, 0.9]), fn) == ([2], 0)
    assert calls == [([0.0, 0.0, 0.5, 0.5], 0)]


def test_speculative_sample_reference_guards() -> None:
    fn = lambda probs, j: int(probs.argmax())
    u = torch.tensor([0.999, 0.5])
    # q(x) = 0 but p(x) > 0: accepted (ratio is infinite).
    q = torch.tensor([[0.0, 1.0, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert speculative_sample_reference([0], q, p, u, fn) == ([0, 2], 1)
    # q(x) = p(x) = 0 and p == q: rejected, residual is all zero, falls back to p.
    q = torch.tensor([[0.0, 0.3, 0.7]])
    p = torch.tensor([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]])
    assert speculative_sample_reference([0], q, p, u, fn) == ([2], 0)
    # d = 0: only the bonus token.
    assert speculative_sample_reference([], q[:0], p[1:], u[:1], fn) == ([0], 0)
    with pytest.raises(ValueError):
        speculative_sample_reference([0, 1], q, p, u, fn)


# ------------------------------------------------------------------------- batched sampling
def _random_sampling_batch(g: torch.Generator, lens: list[int], vocab: int):
    """Processed target probs (with top-k zeros), a nearby draft q, drafts x ~ q."""
    bs, n_t = len(lens), sum(lens) + len(lens)
    t_logits = torch.randn(n_t, vocab, generator=g) * 2.0
    p = top_k_top_p_min_p_renorm(
        torch.softmax(t_logits, -1),
        torch.randint(3, vocab + 1, (n_t,), generator=g),
        torch.full((n_t,), 0.95),
        torch.zeros(n_t),
    )
    draft_rows = torch.cat(
        [torch.arange(s, s + d) for s, d in zip(_offsets(lens, 1), lens, strict=True)]
    )
    q_logits = t_logits[draft_rows] + torch.randn(len(draft_rows), vocab, generator=g)
    q = torch.softmax(q_logits, -1)  # [sum d, V]
    if lens[1] > 0:  # request 1 drafts with q == p: always fully accepted
        s = _offsets(lens, 0)[1]
        q[s : s + lens[1]] = p[draft_rows[s : s + lens[1]]]
    draft_seeds = torch.randint(0, 2**62, (len(draft_rows),), generator=g)
    draft_tokens = sample_from_probs(q, draft_seeds, torch.zeros_like(draft_seeds))
    seeds = torch.randint(-(2**62), 2**62, (bs,), generator=g)
    base_pos = torch.randint(0, 1000, (bs,), generator=g)
    return p, q, draft_tokens, seeds, base_pos


@pytest.mark.parametrize("trial", range(8))
def test_speculative_sample_batched_matches_reference(trial: int) -> None:
    g = torch.Generator().manual_seed(100 + trial)
    lens = [0, 4, 3, 1, 0, 5, 2, 4]
    vocab = 40
    p, q, draft_tokens, seeds, base_pos = _random_sampling_batch(g, lens, vocab)
    t_starts = _offsets(lens, 1)
    # Accept uniforms, aligned with the target rows: row j of request i at position base_i + j.
    row_req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens) + 1)
    row_pos = base_pos[row_req] + torch.arange(p.shape[0]) - torch.tensor(t_starts)[row_req]
    uniforms = uniform_noise(seeds[row_req], row_pos, 1, STREAM_SPEC_ACCEPT).view(-1)

    def batch_fn(probs: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return sample_from_probs(probs, seeds, base_pos + steps, STREAM_SPEC_RESAMPLE)

    out_ids, n_acc = speculative_sample(draft_tokens, torch.tensor(lens), q, p, uniforms, batch_fn)
    assert out_ids.shape == (len(lens), max(lens) + 1)
    host = speculative_sample(draft_tokens, torch.tensor(lens), q, p, uniforms, batch_fn, lens)
    assert torch.equal(host.output_ids, out_ids) and torch.equal(host.num_accepted, n_acc)

    ref, d0 = [], 0
    for i, d in enumerate(lens):
        t0 = t_starts[i]

        def row_fn(probs: torch.Tensor, j: int, i: int = i) -> int:
            pos = base_pos[i : i + 1] + j
            return int(sample_from_probs(probs[None], seeds[i : i + 1], pos, STREAM_SPEC_RESAMPLE))

        toks, n = speculative_sample_reference(
            draft_tokens[d0 : d0 + d].tolist(),
            q[d0 : d0 + d],
            p[t0 : t0 + d + 1],
            uniforms[t0 : t0 + d + 1],
            row_fn,
        )
        d0 += d
        ref.append(toks)
        assert n_acc[i].item() == n, i
        assert out_ids[i].tolist() == toks + [-1] * (max(lens) + 1 - len(toks)), i
    assert n_acc[1].item() == lens[1]  # q == p: every draft accepted
    assert torch.equal(out_ids[out_ids >= 0], _flat_reference_tokens(ref))


def test_speculative_sample_batched_covers_rejections_and_full_accepts() -> None:
    # Across a few batches the accept lengths include 0, partial and full chains, so the
    # equality test above exercises every branch.
    seen = set()
    for trial in range(8):
        g = torch.Generator().manual_seed(100 + trial)
        lens = [0, 4, 3, 1, 0, 5, 2, 4]
        p, q, draft_tokens, seeds, base_pos = _random_sampling_batch(g, lens, 40)
        u = torch.rand(p.shape[0], generator=g)
        fn = lambda probs, steps: probs.argmax(-1)
        _, n_acc = speculative_sample(draft_tokens, torch.tensor(lens), q, p, u, fn)
        for n, d in zip(n_acc.tolist(), lens, strict=True):
            if d > 0:
                seen.add("none" if n == 0 else "full" if n == d else "partial")
    assert seen == {"none", "partial", "full"}


# -------------------------------------------------------------------------- distribution test
V = 8
P1_RAW = torch.tensor([0.04, 0.30, 0.10, 0.02, 0.20, 0.12, 0.15, 0.07])
Q1 = torch.tensor([0.20, 0.05, 0.25, 0.10, 0.05, 0.15, 0.05, 0.15])


def _filtered(raw: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """raw [B, V] -> top-k / top-p filtered and renormalised (the engine's processed p)."""
    b = raw.shape[0]
    ks, ps = torch.full((b,), top_k), torch.full((b,), top_p)
    return top_k_top_p_min_p_renorm(raw, ks, ps, torch.zeros(b))


def _two_step_tables() -> tuple[torch.Tensor, ...]:
    """p1 [V], q1 [V], p2 [V, V] and q2 [V, V] (row a: distribution after first token a)."""
    p1 = _filtered(P1_RAW[None], top_k=6, top_p=0.8)[0]  # keeps 5 tokens: top-p binds
    rolled = torch.stack([P1_RAW.roll(a) for a in range(V)])  # [V, V]
    p2 = _filtered(rolled, top_k=3, top_p=0.95)  # top-k binds
    q2 = torch.stack([Q1.roll(2 * a + 1) for a in range(V)])  # [V, V]
    return p1, Q1, p2, q2


def _run_chain(n: int, q1: torch.Tensor, q2: torch.Tensor, q1_claimed: torch.Tensor):
    """n requests with a 2-token chain; drafts from (q1, q2), verified claiming q1_claimed."""
    p1, _, p2, _ = _two_step_tables()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 12345
    zero, one = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)
    x1 = sample_from_probs(q1.expand(n, V), seeds, zero, STREAM_SAMPLE + 7)
    x2 = sample_from_probs(q2[x1], seeds, one, STREAM_SAMPLE + 7)
    draft_tokens = torch.stack([x1, x2], 1).view(-1)  # [2n]
    q = torch.stack([q1_claimed.expand(n, V), q2[x1]], 1).view(-1, V)  # [2n, V]
    bonus = torch.full((n, V), 1.0 / V)
    p = torch.stack([p1.expand(n, V), p2[x1], bonus], 1).view(-1, V)  # [3n, V]
    pos = torch.arange(3).repeat(n)
    uniforms = uniform_noise(seeds.repeat_interleave(3), pos, 1, STREAM_SPEC_ACCEPT).view(-1)
    fn = lambda probs, steps: sample_from_probs(probs, seeds, steps, STREAM_SPEC_RESAMPLE)
    out_ids, n_acc = speculative_sample(draft_tokens, torch.full((n,), 2), q, p, uniforms, fn)
    return out_ids, n_acc, x1


N_SAMPLES = 40_000


def test_first_token_distribution_matches_target() -> None:
    p1, q1, p2, q2 = _two_step_tables()
    assert (p1 > 0).sum() == 5 and torch.all((p2 > 0).sum(-1) == 3)
    out_ids, n_acc, x1 = _run_chain(N_SAMPLES, q1, q2, q1)
    stat, dof = chi2_test(torch.bincount(out_ids[:, 0], minlength=V), p1)
    assert chi2_sf(stat, dof) > 1e-3, (stat, dof)
    # Power checks: the raw drafts, or verification told the wrong q, fail the same test.
    stat, dof = chi2_test(torch.bincount(x1, minlength=V) * (p1 > 0), p1)
    assert chi2_sf(stat, dof) < 1e-9
    out_bad, _, _ = _run_chain(N_SAMPLES, q1, q2, torch.full((V,), 1.0 / V))
    stat, dof = chi2_test(torch.bincount(out_bad[:, 0], minlength=V), p1)
    assert chi2_sf(stat, dof) < 1e-9


def test_second_token_distribution_matches_target() -> None:
    p1, q1, p2, q2 = _two_step_tables()
    out_ids, n_acc, _ = _run_chain(N_SAMPLES, q1, q2, q1)
    assert 0.2 < (n_acc == 0).float().mean() < 0.8  # both paths are well represented
    t1, t2 = out_ids[:, 0], out_ids[:, 1]
    # Given the first draft was accepted and t1 = a, the step's second token is ~ p2[a]:
    # one chi-square per a, summed (independent groups: dofs add).
    stat, dof = 0.0, 0
    cont = n_acc >= 1
    for a in range(V):
        rows = cont & (t1 == a)
        if rows.sum() > 0:
            s, k = chi2_test(torch.bincount(t2[rows], minlength=V), p2[a])
            stat, dof = stat + s, dof + k
    assert dof == 5 * 2 and chi2_sf(stat, dof) > 1e-3, (stat, dof)
    # Joint: where the step stopped after one token, the next decode step samples from p2[t1];
    # the pair (t1, t2) must then be ~ p1(a) p2(b | a).
    seeds = torch.arange(N_SAMPLES, dtype=torch.int64) + 999
    nxt = sample_from_probs(p2[t1], seeds, torch.ones_like(seeds), STREAM_SAMPLE)
    t2_full = torch.where(cont, t2, nxt)
    joint = torch.bincount(t1 * V + t2_full, minlength=V * V)
    stat, dof = chi2_test(joint, (p1[:, None] * p2).flatten())
    assert dof == 5 * 3 - 1 and chi2_sf(stat, dof) > 1e-3, (stat, dof)
