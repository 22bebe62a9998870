"""EAGLE (v1/v2) drafts: loading upstream-format checkpoints, the forward against a plain torch
reference of the architecture (fc over [embed; hidden], layer 0 without input norm, no final
norm, the target's lm_head), refusals, and --speculative-algorithm EAGLE in the scheduler
(greedy output identical to no speculation; drafts equal to a reference draft fed HF
transformers' final hidden states; draft KV kept across d = 0 steps)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import get_model
from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle
from sglang.srt.speculative.draft_config import load_draft_model
from sglang.srt.speculative.eagle_worker_v2 import drafts_by_request
from sglang.test.forward_harness import ForwardHarness
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit
from sglang.test.tiny_eagle import load_eagle_state_dict, make_tiny_eagle_dir
from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir

K = 3
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    mc = ModelConfig(tiny_model_dir)
    return get_model(mc), mc


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    return {
        "plain": make_tiny_eagle_dir(str(root / "plain"), tiny_model_dir, seed=1, std=0.2),
        "prefixed_2l": make_tiny_eagle_dir(
            str(root / "p2"), tiny_model_dir, seed=2, num_layers=2, std=0.2, prefix="model."
        ),
        "no_bias": make_tiny_eagle_dir(str(root / "nb"), tiny_model_dir, seed=3, fc_bias=False),
        "eagle3": make_tiny_eagle3_dir(str(root / "e3"), tiny_model_dir),
    }


# ---------------------------------------------------------------- plain torch reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # [T, heads, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_draft(sd, cfg, embed, head, ids, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE draft over one sequence (positions 0..T-1) from checkpoint tensors, as in
    SafeAILab/EAGLE cnets.py. Returns (logits [T, V], pre-lm_head hidden [T, H])."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    x = torch.cat([embed[ids], hidden], -1) @ sd["fc.weight"].T
    if "fc.bias" in sd:
        x = x + sd["fc.bias"]
    t = len(ids)
    pos = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = x if i == 0 else _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rope((h @ sd[p + "self_attn.q_proj.weight"].T).view(t, nq, hd), pos, theta)
        k = _rope((h @ sd[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd), pos, theta)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~causal, float("-inf")).softmax(-1), v)
        x = x + a.reshape(t, nq * hd) @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    return x @ head.T, x


def _cfg(d: str) -> dict:
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _run(draft, d, reqs, hiddens):
    h = ForwardHarness(draft, ModelConfig(d))
    slots = [h.new_request() for _ in reqs]
    batch = h.build_batch(list(zip(slots, reqs, strict=True)), all_logits=True)
    h.attn_backend.init_forward_metadata(batch)
    return draft(batch.input_ids, batch.positions, batch, torch.cat(hiddens))


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("which", ["plain", "prefixed_2l", "no_bias"])
def test_load_and_forward_match_reference(target, dirs, which):
    model, mc = target
    d = dirs[which]
    model.set_eagle3_layers_to_capture([-1, 0, 1])  # loading an EAGLE draft turns this off
    draft = load_draft_model(d, model, mc, algorithm="EAGLE")
    assert isinstance(draft, LlamaForCausalLMEagle)
    assert model.capture_aux_hidden_states is False
    assert draft.config.draft_vocab_size is None
    embed, head = model.get_embed_and_head()
    assert draft.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert draft.lm_head.weight.data_ptr() == head.data_ptr()
    assert isinstance(draft.layers[0].input_layernorm, torch.nn.Identity)
    sd, cfg = load_eagle_state_dict(d), _cfg(d)
    if which == "no_bias":
        assert torch.count_nonzero(draft.fc.bias) == 0
    else:
        torch.testing.assert_close(draft.fc.bias, sd["fc.bias"])
    gen = torch.Generator().manual_seed(0)
    ids_a, ids_b = [5, 17, 300, 42, 7], [1000, 3, 77]
    hid_a = torch.randn(len(ids_a), mc.hidden_size, generator=gen)
    hid_b = torch.randn(len(ids_b), mc.hidden_size, generator=gen)
    out = _run(draft, d, [ids_a, ids_b], [hid_a, hid_b])
    assert out.logits.shape == (8, mc.vocab_size) and out.logits.dtype == torch.float32
    assert out.hidden_states.shape == (8, mc.hidden_size)
    for rows, ids, hid in ((slice(0, 5), ids_a, hid_a), (slice(5, 8), ids_b, hid_b)):
        ref_logits, ref_hidden = reference_draft(sd, cfg, embed, head, torch.tensor(ids), hid)
        torch.testing.assert_close(out.logits[rows], ref_logits, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(out.hidden_states[rows], ref_hidden, rtol=1e-4, atol=1e-4)
    assert draft.map_to_target(torch.tensor([0, 9, 49151])).tolist() == [0, 9, 49151]


def test_prefixed_and_plain_names_load_the_same(target, dirs, tiny_model_dir, tmp_path):
    model, mc = target
    plain = make_tiny_eagle_dir(str(tmp_path / "a"), tiny_model_dir, seed=5, num_layers=2)
    pref = make_tiny_eagle_dir(
        str(tmp_path / "b"), tiny_model_dir, seed=5, num_layers=2, prefix="model."
    )
    a = load_draft_model(plain, model, mc).state_dict()
    b = load_draft_model(pref, model, mc).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "layers.1.input_layernorm.weight" in a and "layers.0.input_layernorm.weight" not in a


def test_draft_steps_over_kv_cache_match_one_shot(target, dirs):
    """Extend over target hidden states, then 2 steps fed the draft's own hidden: equal to one
    pass over all rows (both layers' KV are used)."""
    model, mc = target
    d = dirs["prefixed_2l"]
    draft = load_draft_model(d, model, mc)
    h = ForwardHarness(draft, ModelConfig(d))
    slot = h.new_request()
    hid = torch.randn(4, mc.hidden_size, generator=torch.Generator().manual_seed(3))
    batch = h.build_batch([(slot, [11, 12, 13, 14])])
    h.attn_backend.init_forward_metadata(batch)
    out = draft(batch.input_ids, batch.positions, batch, hid)
    hiddens, step_logits = [out.hidden_states], [out.logits]
    for tok in (21, 22):
        batch = h.build_batch([(slot, [tok])])
        h.attn_backend.init_forward_metadata(batch)
        out = draft(batch.input_ids, batch.positions, batch, hiddens[-1])
        hiddens.append(out.hidden_states)
        step_logits.append(out.logits)
    full = _run(draft, d, [[11, 12, 13, 14, 21, 22]], [hid, hiddens[0], hiddens[1]])
    torch.testing.assert_close(torch.cat(step_logits), full.logits[3:], rtol=1e-4, atol=1e-3)
    assert not torch.allclose(step_logits[1], step_logits[2])
    with pytest.raises(ValueError, match="width 192"):
        draft(batch.input_ids, batch.positions, batch, torch.zeros(1, 3 * mc.hidden_size))


# ---------------------------------------------------------------- refusals


def _variant(src: str, dst, **changes) -> str:
    cfg = _cfg(src)
    cfg.update(changes)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        data = f.read()
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(data)
    return str(dst)


@pytest.mark.parametrize(
    "changes, algorithm, message",
    [
        ({"hidden_size": 32}, None, r"draft hidden_size \(32\) != target hidden_size \(64\)"),
        ({"vocab_size": 32000}, None, r"draft vocab_size \(32000\) != target vocab_size"),
        ({"num_hidden_layers": 0}, None, "num_hidden_layers is 0; need at least 1"),
        ({"hot_vocab_size": 100}, None, "hot_vocab_size is not supported"),
        ({}, "EAGLE3", r"--speculative-algorithm EAGLE3 does not match .* is an EAGLE draft"),
        ({"architectures": ["LlamaForCausalLM"]}, None, "is not supported: expected one of"),
        (
            {"num_hidden_layers": 3},
            None,
            r"no weights for 12 tensor\(s\).*layers\.1\.input_layernorm",
        ),
    ],
)
def test_refusals(target, dirs, tmp_path, changes, algorithm, message):
    model, mc = target
    bad = _variant(dirs["plain"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_draft_model(bad, model, mc, algorithm=algorithm)


def test_algorithm_mismatch_refused_by_the_server(tiny_model_dir, dirs):
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE does not match"):
        make_scheduler(
            tiny_model_dir,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=dirs["eagle3"],
        )
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE3 does not match"):
        make_scheduler(
            tiny_model_dir,
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=dirs["plain"],
        )


# ---------------------------------------------------------------- scheduler


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    sched = make_scheduler(tiny_model_dir)
    outs: dict = {}
    for i, p in enumerate(prompts(8)):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    return {rid: o["output_ids"] for rid, o in outs.items()}


def eagle_scheduler(tiny_model_dir, draft_dir):
    return make_scheduler(
        tiny_model_dir,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=K,
    )


def record_drafts(sched) -> list[tuple[list[int], list[int]]]:
    """Wrap the worker's drafting; records (committed tokens x_0..x_n, drafts) per request."""
    worker, real = sched.tp_worker, sched.tp_worker.draft_tokens
    records: list[tuple[list[int], list[int]]] = []

    def draft_tokens(mwb):
        drafts, q = real(mwb)
        reqs = {r.req_pool_idx: r for r in sched.running}
        by_req = drafts_by_request(drafts, mwb.spec.draft_lens)
        for idx, n, ds in zip(mwb.req_pool_indices, mwb.extend_prefix_lens, by_req, strict=True):
            seq = reqs[idx].origin_input_ids + reqs[idx].output_ids
            assert len(seq) == n + 1
            if ds:
                records.append((seq, ds))
        return drafts, q

    worker.draft_tokens = draft_tokens
    return records


def test_greedy_identical_and_drafts_match_reference(tiny_model_dir, dirs, reference):
    """8 prompts, K = 3, 2-layer draft: output equals no speculation, and every proposed
    chain equals a plain-torch EAGLE draft fed HF transformers' final hidden states."""
    d = dirs["prefixed_2l"]
    sched = eagle_scheduler(tiny_model_dir, d)
    assert sched.tp_worker.draft.kv_pool.layer_num == 2
    assert sched.tp_worker.model_runner.model.capture_aux_hidden_states is False
    records = record_drafts(sched)
    outs: dict = {}
    for i, p in enumerate(prompts(8)):
        submit(sched, f"r{i}", p, GREEDY)
    run_until_idle(sched, outs)
    for i in range(8):
        assert outs[f"r{i}"]["output_ids"] == reference[f"r{i}"]
        assert outs[f"r{i}"]["meta"]["spec_num_proposed_drafts"] > 0
    sched.kv.check_accounting()

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    sd, cfg = load_eagle_state_dict(d), _cfg(d)
    embed = hf.get_input_embeddings().weight.detach()
    head = hf.get_output_embeddings().weight.detach()
    assert len(records) >= 40
    with torch.no_grad():
        for seq, drafts in records[::2][:20]:
            hid = hf.model(torch.tensor([seq[:-1]])).last_hidden_state[0]  # [n, H], after norm
            ids, ref = list(seq[1:]), []
            for _ in drafts:
                logits, out = reference_draft(sd, cfg, embed, head, torch.tensor(ids), hid)
                ref.append(int(logits[-1].argmax()))
                ids.append(ref[-1])
                hid = torch.cat([hid, out[-1:]])
            assert drafts == ref


def test_d0_requests_mixed_in_and_toggled_keep_draft_state(tiny_model_dir, dirs, reference):
    """max_draft_tokens 0 requests in the same batches as drafting ones change no output; a
    request toggled between d = 0 and d = K proposes exactly what an untoggled one does at the
    same positions (the catch-up draft extend restored the draft KV of all layers)."""
    d = dirs["prefixed_2l"]
    sched = eagle_scheduler(tiny_model_dir, d)
    outs: dict = {}
    ps = prompts(8)
    for i in range(8):
        submit(sched, f"r{i}", ps[i], {**GREEDY, "max_draft_tokens": [0, K][i % 2]})
    run_until_idle(sched, outs)
    for i in range(8):
        assert outs[f"r{i}"]["output_ids"] == reference[f"r{i}"]
        proposed = outs[f"r{i}"]["meta"]["spec_num_proposed_drafts"]
        assert proposed == 0 if i % 2 == 0 else proposed > 0
    sched.kv.check_accounting()

    def run(toggle: bool) -> tuple[list[int], dict[int, list[int]]]:
        s = eagle_scheduler(tiny_model_dir, d)
        records = record_drafts(s)
        step = {"n": 0}
        base = s.spec.choose_draft_lens

        def toggled(reqs):
            step["n"] += 1
            return [0 if toggle and (step["n"] // 3) % 2 else x for x in base(reqs)]

        s.spec.choose_draft_lens = toggled
        o: dict = {}
        submit(s, "r", ps[3], {**GREEDY, "max_new_tokens": 30})
        run_until_idle(s, o)
        s.kv.check_accounting()
        return o["r"]["output_ids"], {len(seq): ds for seq, ds in records}

    plain_out, plain_props = run(False)
    tog_out, tog_props = run(True)
    assert tog_out == plain_out
    common = set(plain_props) & set(tog_props)
    assert len(common) >= 3
    assert all(plain_props[n] == tog_props[n] for n in common)
