"""Tests for SamplingParams, SamplingBatchInfo, penalties, seeded noise and the Sampler (CPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from sglang.srt.layers.sampler import Sampler, compute_logprobs, top_k_top_p_min_p_renorm
from sglang.srt.sampling.random import mix64, to_int64_seed, uniform_noise
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    seed: int = 0
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def _req(seed: int = 0, output_ids: list[int] | None = None, **params) -> FakeReq:
    return FakeReq(SamplingParams(**params), seed, [], list(output_ids or []))


# ---------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    "params, name",
    [
        ({"foo": 1}, "'foo'"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"top_k": 2.0}, "top_k"),
        ({"n": "2"}, "n"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": "x"}}, "logit_bias"),
        ({"logit_bias": {"3": 100.5}}, 'logit_bias["3"] must be a number in [-100, 100]'),
        ({"logit_bias": {"3": -101}}, 'logit_bias["3"] must be a number in [-100, 100]'),
        ({"logit_bias": {"3": float("nan")}}, "got NaN"),
        ({"logit_bias": {"3": True}}, "got true"),
        ({"logit_bias": {"5_0": 1}}, 'logit_bias key "5_0" is not a token id'),  # int() takes it
        ({"logit_bias": {" 5": 1}}, 'logit_bias key " 5" is not a token id'),
        ({"sampling_seed": 1.0}, "sampling_seed"),
        ({"json_schema": "{}"}, "json_schema"),
        ({"regex": "a+"}, "regex"),
        ({"ebnf": "root ::= 'a'"}, "ebnf"),
    ],
)
def test_from_dict_rejects_bad_keys_and_types(params: dict, name: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(params)
    assert name in str(err.value)


@pytest.mark.parametrize(
    "params, name, value",
    [
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": 0}, "top_k", "0"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"min_p": 1.1}, "min_p", "1.1"),
        ({"max_new_tokens": -1}, "max_new_tokens", "-1"),
        ({"min_new_tokens": -1}, "min_new_tokens", "-1"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens", "10"),
        ({"n": 0}, "n", "0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "2.5"),
        ({"presence_penalty": -3.0}, "presence_penalty", "-3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "2.5"),
        ({"stop_token_ids": [1, 100]}, "stop_token_ids", "100"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
        ({"logit_bias": {"100": 1.0}}, "logit_bias", "100"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias", "-1"),
        ({"max_draft_tokens": -1}, "max_draft_tokens", "-1"),
    ],
)
def test_verify_rejects_out_of_range(params: dict, name: str, value: str) -> None:
    sp = SamplingParams.from_dict(params)
    with pytest.raises(ValueError) as err:
        sp.verify(vocab_size=100)
    msg = str(err.value)
    assert name in msg and value in msg


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer >= 0, got 2.0"),
        ({"max_new_tokens": 1e20}, "max_new_tokens must be an integer >= 0, got 1e+20"),
        ({"top_k": True}, "top_k must be an integer >= 1, or -1 (all), got true"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got Infinity"),
        ({"top_p": 10**400}, "top_p must be a finite number in (0, 1], got 1000"),
    ],
)
def test_type_errors_quote_the_range(params: dict, message: str) -> None:
    """Wrong types (floats for integers, bools, non-finite numbers) name the parameter and its
    range, and quote the value as JSON, without Python type names."""
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(params)
    assert message in str(err.value) and "float" not in str(err.value)


def test_verify_checks_logit_bias_values_of_direct_construction() -> None:
    """SamplingParams built without from_dict (Engine callers) get the same range check."""
    with pytest.raises(ValueError, match=r'logit_bias\["7"\] must be a number in \[-100, 100\]'):
        SamplingParams(logit_bias={"7": 1e9}).verify(100)
    SamplingParams(logit_bias={7: -100, "8": 100.0}).verify(100)


def test_defaults_and_valid_params_pass() -> None:
    sp = SamplingParams.from_dict(None)
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.n) == (128, 1.0, 1.0, -1, 1)
    sp.verify(100)
    sp = SamplingParams.from_dict(
        {"temperature": 0, "top_p": 1, "stop_token_ids": [99], "logit_bias": {"5": 2}}
    )
    sp.verify(100)
    assert sp.temperature == 0.0 and isinstance(sp.temperature, float)
    assert SamplingParams.from_dict(sp.to_dict()) == sp


class _CharPairTokenizer:
    """Fake tokenizer: one token per two characters."""

    def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(math.ceil(len(s) / 2)))


def test_normalize() -> None:
    sp = SamplingParams(temperature=0.0, stop="abcde", logit_bias={"7": 1})
    sp.normalize(_CharPairTokenizer())
    assert sp.stop_strs == ["abcde"] and sp.stop_str_max_len == 3
    assert sp.top_k == 1 and sp.temperature == 1.0 and sp.is_greedy
    assert sp.logit_bias == {7: 1.0}
    sp = SamplingParams(stop=["ab", "abcdefg"])
    sp.normalize(None)
    assert sp.stop_str_max_len == 7 and sp.top_k == TOP_K_ALL and not sp.is_greedy


# ---------------------------------------------------------------------------- noise
def test_uniform_noise_is_counter_based() -> None:
    seeds = torch.tensor([7, 8, 7, 7], dtype=torch.int64)
    pos = torch.tensor([3, 3, 3, 4], dtype=torch.int64)
    u = uniform_noise(seeds, pos, 5000)
    assert u.shape == (4, 5000) and u.dtype == torch.float32
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert torch.equal(u[0], u[2])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[3])
    assert abs(u.mean().item() - 0.5) < 0.01
    for stream in (1, 2, 3):
        assert not torch.equal(u[0], uniform_noise(seeds, pos, 5000, stream=stream)[0])
    # The first outputs of the published splitmix64 generator seeded with 0 are
    # mix64(k * golden) for k = 1, 2, 3.
    golden = 0x9E3779B97F4A7C15
    x = mix64(torch.tensor([to_int64_seed(k * golden) for k in (1, 2, 3)], dtype=torch.int64))
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert x.tolist() == [to_int64_seed(v) for v in expected]
    assert to_int64_seed(2**64 + 5) == 5 and to_int64_seed(2**64 - 1) == -1


# ---------------------------------------------------------------------------- sampler
def _sample(reqs: list[FakeReq], logits: torch.Tensor, eos: set[int] | None = None, **kw):
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[-1], "cpu", eos)
    return Sampler()(logits, info, **kw)


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    greedy = [_req(seed=i, temperature=0.0) for i in range(16)]
    out = _sample(greedy, logits)
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
    topk1 = [_req(seed=i, top_k=1, temperature=1.0) for i in range(16)]
    assert torch.equal(_sample(topk1, logits).next_token_ids, out.next_token_ids)
    # Mixed batch: greedy rows stay exact argmax next to sampled rows.
    mixed = [_req(seed=i, temperature=0.0 if i % 2 else 1.5) for i in range(16)]
    ids = _sample(mixed, logits).next_token_ids
    assert torch.equal(ids[1::2], torch.argmax(logits, dim=-1)[1::2])


def test_same_seed_same_samples_regardless_of_batch() -> None:
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 500, generator=g)  # one request's logits
    others = torch.randn(7, 500, generator=g)
    params = {"temperature": 1.3, "top_p": 0.95}
    for step in range(5):  # output position = step
        alone = _sample([_req(42, [0] * step, **params)], row).next_token_ids
        batch = [_req(s, [1] * (s % 4), temperature=0.8) for s in range(7)]
        batch.insert(3, _req(42, [0] * step, **params))
        logits = torch.cat([others[:3], row, others[3:]])
        assert _sample(batch, logits).next_token_ids[3] == alone[0]


def test_different_seeds_differ() -> None:
    logits = torch.zeros(64, 1000)  # uniform distribution
    a = _sample([_req(1, [0] * i) for i in range(64)], logits).next_token_ids
    b = _sample([_req(2, [0] * i) for i in range(64)], logits).next_token_ids
    a2 = _sample([_req(1, [0] * i) for i in range(64)], logits).next_token_ids
    assert torch.equal(a, a2)
    assert (a != b).sum().item() > 55  # ~63.9 expected for independent uniforms


def _reference_distribution(logits: list[float], t: float, k: int, p: float, mp: float):
    """Straightforward per-token implementation of the processed distribution."""
    exps = [math.exp(x / t) for x in logits]
    probs = [e / sum(exps) for e in exps]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for rank, i in enumerate(order):
        if rank >= k or (p < 1.0 and mass >= p):
            break
        keep.add(i)
        mass += probs[i]
    keep = {i for i in keep if probs[i] >= mp * probs[order[0]]}
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    "t, k, p, mp",
    [
        (1.0, -1, 1.0, 0.0),
        (0.6, -1, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.3, -1, 0.7, 0.0),
        (1.0, -1, 1.0, 0.3),
        (0.9, 5, 0.9, 0.05),
    ],
)
def test_empirical_distribution_matches(t: float, k: int, p: float, mp: float) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    logits = [1.0, 2.5, 0.3, -1.0, 2.0, 0.0, 1.7, -0.5]
    expected = _reference_distribution(logits, t, 8 if k == -1 else k, p, mp)
    n = 20000
    reqs = [_req(seed=1000 + i, temperature=t, top_k=k, top_p=p, min_p=mp) for i in range(n)]
    ids = _sample(reqs, torch.tensor([logits]).expand(n, -1).contiguous()).next_token_ids
    counts = torch.bincount(ids, minlength=8).tolist()
    support = [i for i, e in enumerate(expected) if e > 0]
    assert all(counts[i] == 0 for i in range(8) if expected[i] == 0)
    f_obs = [counts[i] for i in support]
    f_exp = [expected[i] * n for i in support]
    if len(support) > 1:
        assert scipy_stats.chisquare(f_obs, f_exp).pvalue > 0.001


def test_renorm_hand_example() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]])
    out = top_k_top_p_min_p_renorm(
        probs,
        top_ks=torch.tensor([2, 4, 4]),
        top_ps=torch.tensor([1.0, 0.7, 1.0]),
        min_ps=torch.tensor([0.0, 0.0, 0.6]),
    )
    expected = torch.tensor(
        [[0.0, 4 / 7, 0.0, 3 / 7], [0.0, 4 / 7, 0.0, 3 / 7], [0.0, 4 / 7, 0.0, 3 / 7]]
    )
    assert torch.allclose(out, expected, atol=1e-6)
    # top_p smaller than the top token's mass keeps only the top token.
    one = top_k_top_p_min_p_renorm(
        probs[:1], torch.tensor([4]), torch.tensor([0.1]), torch.zeros(1)
    )
    assert one.tolist() == [[0.0, 1.0, 0.0, 0.0]]


# ---------------------------------------------------------------------------- penalties
def test_penalties_hand_example() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 0.0]] * 2)
    penalised = FakeReq(
        SamplingParams(
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            logit_bias={"4": 3.0},
            min_new_tokens=5,
            stop_token_ids=[1],
        ),
        seed=0,
        origin_input_ids=[0, 1],
        output_ids=[2, 2, 3],
    )
    plain = FakeReq(SamplingParams(), seed=0, origin_input_ids=[0, 1], output_ids=[2, 2, 3])
    info = SamplingBatchInfo.from_reqs([penalised, plain], 6, "cpu", eos_token_ids={5})
    out = info.apply_logits_processors(logits)
    inf = float("inf")
    # rep: seen {0,1,2,3}: 1/2, -1*2, 2/2, -2*2; freq/pres on 2 (x2) and 3 (x1); bias on 4.
    assert out[0].tolist() == [0.5, -inf, 1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 3.5, -inf]
    assert out[1].tolist() == logits[1].tolist()
    assert logits[0].tolist() == [1.0, -1.0, 2.0, -2.0, 0.5, 0.0]  # input untouched
    # min_new_tokens reached: eos and stop ids are allowed again.
    penalised.output_ids = [2, 2, 3, 4, 4]
    info = SamplingBatchInfo.from_reqs([penalised], 6, "cpu", eos_token_ids={5})
    out = info.apply_logits_processors(logits[:1])
    assert out[0, 5].item() == 0.0 and out[0, 1].item() == -2.0


def test_min_new_tokens_blocks_eos_in_sampling() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0]])
    req = _req(temperature=0.0, min_new_tokens=2)
    assert _sample([req], logits, eos={2}).next_token_ids.tolist() == [0]
    req.output_ids = [0, 1]
    assert _sample([req], logits, eos={2}).next_token_ids.tolist() == [2]


def test_expand_matches_per_position_batches() -> None:
    base = FakeReq(
        SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5, min_new_tokens=2),
        seed=9,
        origin_input_ids=[1, 2],
        output_ids=[3],
    )
    other = _req(seed=4, output_ids=[0, 0, 0], temperature=0.7, min_new_tokens=5)
    info = SamplingBatchInfo.from_reqs([base, other], 10, "cpu", {0})
    drafts = [[5, 5, 6], [7]]
    wide = info.expand([3, 2], drafts)
    assert wide.random_positions.tolist() == [1, 2, 3, 3, 4]
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(3))
    wide_out = wide.apply_logits_processors(logits)
    row = 0
    for req, count, d in [(base, 3, drafts[0]), (other, 2, drafts[1])]:
        for j in range(count):
            r = FakeReq(req.sampling_params, req.seed, req.origin_input_ids, req.output_ids + d[:j])
            single = SamplingBatchInfo.from_reqs([r], 10, "cpu", {0})
            assert torch.equal(
                single.apply_logits_processors(logits[row : row + 1])[0], wide_out[row]
            )
            assert single.random_positions.item() == wide.random_positions[row].item()
            row += 1
    with pytest.raises(ValueError):
        info.expand([3, 3], drafts)
    # drafts left on the device (None): refused while a penalty reads them
    assert info.reads_output_ids and info.has_logits_processors
    with pytest.raises(ValueError, match="penalties read the drafts"):
        info.expand([3, 2], None)


def test_expand_without_host_drafts() -> None:
    """Rows whose processors read no ids (min_new_tokens, logit_bias) expand the same with the
    drafts unknown; a batch without processors reports none, expanded or not."""
    biased = _req(seed=2, output_ids=[1], min_new_tokens=3, logit_bias={"4": 1.5})
    info = SamplingBatchInfo.from_reqs([biased, _req(seed=3, output_ids=[0, 2])], 10, "cpu", {0})
    assert not info.reads_output_ids and info.has_logits_processors
    known, unknown = info.expand([3, 2], [[5, 6], [7]]), info.expand([3, 2], None)
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(4))
    assert torch.equal(
        known.apply_logits_processors(logits), unknown.apply_logits_processors(logits)
    )
    assert known.random_positions.tolist() == unknown.random_positions.tolist() == [1, 2, 3, 2, 3]
    # min_new_tokens = 3: rows at output lengths 1 and 2 are blocked, the one at 3 is not
    assert unknown.min_tokens_active.tolist() == [True, True, False, False, False]
    plain = SamplingBatchInfo.from_reqs([_req(seed=5, output_ids=[3, 3, 3])], 10, "cpu", {0})
    assert not plain.has_logits_processors
    assert not plain.expand([4], None).has_logits_processors


# ---------------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_at_chosen_ids() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=g)
    reqs = [_req(seed=i, temperature=0.7, repetition_penalty=1.5, output_ids=[1]) for i in range(4)]
    out = _sample(reqs, logits, return_logprob=True, top_logprobs_nums=[0, 1, 3, 5])
    ref = torch.log_softmax(logits, dim=-1)
    chosen = ref.gather(1, out.next_token_ids.view(-1, 1)).view(-1)
    assert torch.allclose(out.next_token_logprobs, chosen, atol=1e-6)
    assert [len(v) for v, _ in out.top_logprobs] == [0, 1, 3, 5]
    vals, ids = out.top_logprobs[3]
    ref_vals, ref_ids = ref[3].topk(5)
    assert ids == ref_ids.tolist()
    assert torch.allclose(torch.tensor(vals), ref_vals, atol=1e-6)
    no_lp = _sample(reqs, logits)
    assert no_lp.next_token_logprobs is None and no_lp.top_logprobs is None
    assert torch.equal(no_lp.next_token_ids, out.next_token_ids)
    lp, top = compute_logprobs(logits, torch.tensor([0, 1, 2, 3]))
    assert top is None and torch.allclose(lp, ref[torch.arange(4), torch.arange(4)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_and_samples_identical_on_cpu_and_cuda() -> None:
    g = torch.Generator().manual_seed(11)
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=g)
    pos = torch.randint(0, 4096, (64,), generator=g)
    u_cpu = uniform_noise(seeds, pos, 49152, stream=2)
    u_gpu = uniform_noise(seeds.cuda(), pos.cuda(), 49152, stream=2).cpu()
    assert torch.equal(u_cpu, u_gpu)
    reqs = [
        _req(seed=int(s), output_ids=[0] * (int(p) % 50)) for s, p in zip(seeds, pos, strict=True)
    ]
    logits = torch.zeros(64, 49152)  # equal probs: the winner is the smallest Exp noise
    ids_cpu = _sample(reqs, logits).next_token_ids
    info = SamplingBatchInfo.from_reqs(reqs, 49152, "cuda")
    ids_gpu = Sampler()(logits.cuda(), info).next_token_ids.cpu()
    assert torch.equal(ids_cpu, ids_gpu)


def test_packed_row_upload_round_trips_bits() -> None:
    """The per-step sampling rows go to the device as one byte buffer (int64 block, then
    float32): unpacking gives the exact values back, extreme seeds and odd sizes included."""
    from sglang.srt.sampling.sampling_batch_info import pack_rows, unpack_rows

    for bs in (1, 3, 8):
        ints = torch.tensor(
            [[1] * bs, [to_int64_seed(2**64 - 1 - i) for i in range(bs)], list(range(bs))],
            dtype=torch.int64,
        )
        floats = torch.tensor([[0.7] * bs, [1.0] * bs, [1e-8 * (i + 1) for i in range(bs)]])
        got_i, got_f = unpack_rows(pack_rows(ints, floats).clone(), ints.shape)
        assert torch.equal(got_i, ints) and torch.equal(got_f, floats)
        assert got_i.dtype == torch.int64 and got_f.dtype == torch.float32
