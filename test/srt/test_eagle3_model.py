"""EAGLE-3 draft model: checkpoint loading/saving, refusals, and the forward against a plain
torch reference of the architecture (upstream llama_eagle3 / SpecForge layout)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.model_loader.loader import get_model
from sglang.srt.speculative.draft_config import (
    aux_layer_ids,
    eagle3_state_dict,
    load_draft_model,
    save_eagle3_checkpoint,
)
from sglang.test.forward_harness import ForwardHarness
from sglang.test.tiny_eagle3 import (
    make_tiny_eagle3_dir,
    random_eagle3_state_dict,
    tiny_eagle3_config,
)

DRAFT_VOCAB = 1000


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    mc = ModelConfig(tiny_model_dir)
    return get_model(mc), mc


@pytest.fixture(scope="module")
def draft_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {
        None: make_tiny_eagle3_dir(str(root / "full"), tiny_model_dir, None, seed=1, std=0.2),
        DRAFT_VOCAB: make_tiny_eagle3_dir(
            str(root / "small"), tiny_model_dir, DRAFT_VOCAB, seed=2, std=0.2
        ),
    }


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # [T, heads, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_draft(sd, cfg, embed, head, ids, aux) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch EAGLE-3 draft over one sequence (positions 0..T-1), from checkpoint tensors.
    Returns (logits [T, V'], pre-norm hidden [T, H])."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "midlayer."
    hidden = aux @ sd["fc.weight"].T
    x = torch.cat(
        [
            _rms(embed[ids], sd[p + "input_layernorm.weight"], eps),
            _rms(hidden, sd[p + "hidden_norm.weight"], eps),
        ],
        -1,
    )
    t = len(ids)
    pos = torch.arange(t)
    q = _rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(t, nq, hd), pos, theta)
    k = _rope((x @ sd[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd), pos, theta)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nq * hd)
    resid = hidden + attn @ sd[p + "self_attn.o_proj.weight"].T
    m = _rms(resid, sd[p + "post_attention_layernorm.weight"], eps)
    mlp = F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
    pre_norm = resid + mlp @ sd[p + "mlp.down_proj.weight"].T
    return _rms(pre_norm, sd["norm.weight"], eps) @ head.T, pre_norm


def _run(draft, draft_dir, reqs, hiddens):
    """Run `draft` on requests [(token ids, hidden [n, W])] in one ragged batch (fresh pools)."""
    h = ForwardHarness(draft, ModelConfig(draft_dir))
    slots = [h.new_request() for _ in reqs]
    batch = h.build_batch(list(zip(slots, reqs, strict=True)), all_logits=True)
    h.attn_backend.init_forward_metadata(batch)
    return draft(batch.input_ids, batch.positions, batch, torch.cat(hiddens))


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
def test_forward_matches_reference(target, draft_dirs, draft_vocab):
    model, mc = target
    d = draft_dirs[draft_vocab]
    draft = load_draft_model(d, model, mc)
    sd = load_file(os.path.join(d, "model.safetensors"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    embed, head = model.get_embed_and_head()
    if draft_vocab is None:
        assert draft.lm_head.weight.data_ptr() == head.data_ptr()
        assert draft.d2t is None and draft.t2d is None
    else:
        head = sd["lm_head.weight"]
        assert draft.lm_head.weight.shape == (DRAFT_VOCAB, mc.hidden_size)
        assert int(draft.t2d.sum()) == DRAFT_VOCAB and draft.t2d.dtype == torch.bool
    assert draft.embed_tokens.weight.data_ptr() == embed.data_ptr()
    gen = torch.Generator().manual_seed(0)
    ids_a, ids_b = [5, 17, 300, 42, 7, 9], [1000, 3, 77]
    aux_a = torch.randn(len(ids_a), 3 * mc.hidden_size, generator=gen)
    aux_b = torch.randn(len(ids_b), 3 * mc.hidden_size, generator=gen)
    out = _run(draft, d, [ids_a, ids_b], [aux_a, aux_b])
    vocab = draft_vocab or mc.vocab_size
    assert out.logits.shape == (9, vocab) and out.logits.dtype == torch.float32
    assert out.hidden_states.shape == (9, mc.hidden_size)
    for rows, ids, aux in ((slice(0, 6), ids_a, aux_a), (slice(6, 9), ids_b, aux_b)):
        ref_logits, ref_hidden = reference_draft(sd, cfg, embed, head, torch.tensor(ids), aux)
        torch.testing.assert_close(out.logits[rows], ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.hidden_states[rows], ref_hidden, rtol=1e-4, atol=1e-4)


def test_draft_steps_over_kv_cache_match_one_shot(target, draft_dirs):
    """Extend over target aux states, then 2 decode steps fed the draft's own hidden: equal to
    recomputing those rows in one pass (the KV of layer 0 is used, [T, hidden] input accepted)."""
    model, mc = target
    d = draft_dirs[DRAFT_VOCAB]
    draft = load_draft_model(d, model, mc)
    h = ForwardHarness(draft, ModelConfig(d))
    slot = h.new_request()
    gen = torch.Generator().manual_seed(3)
    aux = torch.randn(4, 3 * mc.hidden_size, generator=gen)
    batch = h.build_batch([(slot, [11, 12, 13, 14])])
    h.attn_backend.init_forward_metadata(batch)
    out = draft(batch.input_ids, batch.positions, batch, aux)
    hiddens, step_logits = [out.hidden_states], [out.logits]
    for tok in (21, 22):
        batch = h.build_batch([(slot, [tok])])
        h.attn_backend.init_forward_metadata(batch)
        out = draft(batch.input_ids, batch.positions, batch, hiddens[-1])
        hiddens.append(out.hidden_states)
        step_logits.append(out.logits)
    # one shot: same rows, the draft-hidden rows passed already projected
    h2 = ForwardHarness(draft, ModelConfig(d))
    s2 = h2.new_request()
    proj = torch.cat([draft.fc(aux), hiddens[0], hiddens[1]])
    batch = h2.build_batch([(s2, [11, 12, 13, 14, 21, 22])], all_logits=True)
    h2.attn_backend.init_forward_metadata(batch)
    full = draft(batch.input_ids, batch.positions, batch, proj)
    torch.testing.assert_close(torch.cat(step_logits), full.logits[3:], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(step_logits[1], step_logits[2])
    with pytest.raises(ValueError, match="width 7"):
        draft.project_hidden(torch.zeros(1, 7))


def test_target_aux_states_feed_the_draft(target, draft_dirs):
    model, mc = target
    d = draft_dirs[DRAFT_VOCAB]
    draft = load_draft_model(d, model, mc)
    # 2-layer target: ids [-1, 0, 1] -> inputs of layers 0, 1 and the last layer's output
    assert model.model.layers_to_capture == [0, 1, 2]
    th = ForwardHarness(model, mc)
    out = th.forward([(th.new_request(), [1, 2, 3, 4])], capture_hidden_mode=CaptureHiddenMode.FULL)
    assert out.hidden_states.shape == (4, 3 * mc.hidden_size)
    embed, _ = model.get_embed_and_head()
    torch.testing.assert_close(out.hidden_states[:, : mc.hidden_size], embed[[1, 2, 3, 4]])
    res = _run(draft, d, [[2, 3, 4, 5]], [out.hidden_states])
    assert torch.isfinite(res.logits).all() and res.logits.shape == (4, DRAFT_VOCAB)


def test_aux_states_are_hf_residual_streams(tiny_model_dir):
    """The captured states are the residual streams that HF transformers' Llama carries at
    those layers: the input of layer i + 1 for each id i (the embedding for -1; HF's
    output_hidden_states[i + 1]), the last layer's output before the final norm (a hook on HF's
    last decoder layer) for id N - 1. Both in a prefill (FULL) and a decode step (LAST, one
    row per token), where the model takes them from its norms' residual outputs (the 2-layer
    tiny target: ids -1, 0, 1, every kind of capture)."""
    from transformers import AutoModelForCausalLM

    mc = ModelConfig(tiny_model_dir)
    model = get_model(mc)
    layer_ids = [-1, 0, 1]
    assert mc.num_hidden_layers == 2
    model.set_eagle3_layers_to_capture(layer_ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    last: list[torch.Tensor] = []
    hook = hf.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    ids = [5, 17, 3, 99, 42]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    hook.remove()
    n = mc.num_hidden_layers
    h = mc.hidden_size

    def expected(i: int) -> torch.Tensor:  # [T, H] of id i over all of ids
        return last[0].reshape(len(ids), h) if i == n - 1 else ref[i + 1][0]

    th = ForwardHarness(model, mc)
    req = th.new_request()
    full = th.forward([(req, ids[:4])], capture_hidden_mode=CaptureHiddenMode.FULL)
    step = th.forward([(req, ids[4:])], capture_hidden_mode=CaptureHiddenMode.LAST)
    got = torch.cat([full.hidden_states, step.hidden_states])  # [5, 3H]
    for k, i in enumerate(layer_ids):
        torch.testing.assert_close(got[:, k * h : (k + 1) * h], expected(i), rtol=1e-4, atol=1e-4)


def test_map_to_target(target, tiny_model_dir, tmp_path):
    model, mc = target
    cfg = tiny_eagle3_config(tiny_model_dir, draft_vocab_size=4)
    sd = random_eagle3_state_dict(cfg)
    hot = torch.tensor([7, 100, 2, 49151])  # draft id i -> target id hot[i]
    sd["d2t"] = hot - torch.arange(4)
    sd["t2d"] = torch.zeros(mc.vocab_size, dtype=torch.bool)
    sd["t2d"][hot] = True
    draft = load_draft_model(save_eagle3_checkpoint(sd, cfg, str(tmp_path)), model, mc)
    assert draft.map_to_target(torch.tensor([[3, 0], [1, 2]])).tolist() == [[49151, 7], [100, 2]]
    assert draft.t2d.nonzero().flatten().tolist() == [2, 7, 100, 49151]


def test_identity_vocab_map(target, draft_dirs):
    model, mc = target
    draft = load_draft_model(draft_dirs[None], model, mc)
    assert draft.map_to_target(torch.tensor([0, 5, 49151])).tolist() == [0, 5, 49151]


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
def test_save_load_round_trip(target, draft_dirs, tmp_path, draft_vocab):
    model, mc = target
    d = draft_dirs[draft_vocab]
    draft = load_draft_model(d, model, mc)
    original = load_file(os.path.join(d, "model.safetensors"))
    state = eagle3_state_dict(draft)
    assert sorted(state) == sorted(original)
    for name, t in original.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name
    out = save_eagle3_checkpoint(draft, draft.config, str(tmp_path / "copy"))
    again = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(again[n], t) for n, t in original.items()) and len(again) == len(state)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg.get("draft_vocab_size") == draft_vocab
    reloaded = load_draft_model(out, model, mc)
    for (n1, t1), (n2, t2) in zip(
        reloaded.state_dict().items(), draft.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_model_prefixed_names_load(target, draft_dirs, tmp_path):
    model, mc = target
    d = draft_dirs[DRAFT_VOCAB]
    sd = load_file(os.path.join(d, "model.safetensors"))
    os.makedirs(tmp_path / "p")
    save_file({f"model.{n}": t for n, t in sd.items()}, str(tmp_path / "p/model.safetensors"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    json.dump(cfg, open(tmp_path / "p/config.json", "w"))
    a = load_draft_model(d, model, mc).state_dict()
    b = load_draft_model(str(tmp_path / "p"), model, mc).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def _write_variant(src: str, dst, **changes) -> str:
    cfg = json.load(open(os.path.join(src, "config.json")))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    os.makedirs(dst, exist_ok=True)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    sd = load_file(os.path.join(src, "model.safetensors"))
    save_file(sd, os.path.join(dst, "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"vocab_size": 32000}, r"draft vocab_size \(32000\) != target vocab_size \(49152\)"),
        ({"hidden_size": 32}, r"draft hidden_size \(32\) != target hidden_size \(64\)"),
        (
            {"target_hidden_size": 128},
            r"draft target_hidden_size \(128\) != target hidden_size \(64\)",
        ),
        ({"draft_vocab_size": 50000}, r"draft_vocab_size \(50000\) must be in \[1, vocab_size"),
        ({"architectures": ["LlamaForCausalLMEagle"]}, "draft_vocab_size is not supported"),
        ({"architectures": ["LlamaForCausalLM"]}, "is not supported: expected one of"),
        ({"num_hidden_layers": 2}, "only 1 is supported"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}}, "3 distinct"),
        ({"eagle_config": None}, "no 3 distinct default EAGLE-3 layers"),
    ],
)
def test_refusals(target, draft_dirs, tmp_path, changes, message):
    model, mc = target
    bad = _write_variant(draft_dirs[DRAFT_VOCAB], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_draft_model(bad, model, mc)


def test_refuses_missing_path_and_tensors(target, draft_dirs, tmp_path):
    model, mc = target
    with pytest.raises(ValueError, match="does not exist"):
        load_draft_model(str(tmp_path / "nope"), model, mc)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="has no config.json"):
        load_draft_model(str(tmp_path / "empty"), model, mc)
    d = draft_dirs[DRAFT_VOCAB]
    dst = _write_variant(d, tmp_path / "partial")
    sd = load_file(os.path.join(d, "model.safetensors"))
    del sd["d2t"], sd["midlayer.mlp.up_proj.weight"]
    save_file(sd, os.path.join(dst, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no weights for 2 tensor\(s\).*d2t.*gate_up_proj"):
        load_draft_model(dst, model, mc)


def test_aux_layer_ids():
    assert aux_layer_ids({}, 30) is None  # upstream default: inputs of layers 2, 15, 27
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert aux_layer_ids(cfg, 30) == [1, 14, 26]
    with pytest.raises(ValueError, match=r"in \[-1, 29\]"):
        aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 30]}}, 30)
    with pytest.raises(ValueError, match="6-layer target"):
        aux_layer_ids({}, 6)  # default [2, 3, 3] is not distinct
