"""EAGLE-3 draft training on a tiny random target: data through the Engine, the training-time
test against the serving draft, loss going down, checkpoint format, resume."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import sglang.srt.speculative.training.trainer as trainer_mod
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import get_model
from sglang.srt.speculative.draft_config import aux_layer_ids, load_draft_model
from sglang.srt.speculative.training.capture import capture_target_states, collate
from sglang.srt.speculative.training.data import (
    TrainingSequence,
    load_prompts_file,
    load_sequences,
    select_draft_vocab,
)
from sglang.srt.speculative.training.evaluate import replay_greedy_decode
from sglang.srt.speculative.training.trainer import TrainConfig, run_training
from sglang.srt.speculative.training.ttt import ttt_unroll
from sglang.test.forward_harness import ForwardHarness
from sglang.train_eagle3 import build_parser, main

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three prime numbers:",
    "Translate 'good morning' into German:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "import numpy as np\n",
]
STEPS = 40


def _config(out_dir: str, target_dir: str, prompts_path: str, **kw) -> TrainConfig:
    base = dict(
        output_dir=out_dir,
        target_model_path=target_dir,
        prompts_path=prompts_path,
        num_prompts=len(PROMPTS),
        raw_prompts=True,
        max_new_tokens=24,
        draft_vocab_size=512,
        steps=STEPS,
        batch_size=4,
        lr=3e-3,
        eval_fraction=0.0,
        device="cpu",
        log_every=1,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_eagle3")
    prompts_path = str(root / "prompts.json")
    json.dump(PROMPTS, open(prompts_path, "w"))
    out = run_training(_config(str(root / "out"), tiny_model_dir, prompts_path))
    return out, prompts_path


def _metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "train_state", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_loss_falls_and_checkpoint_loads(trained, tiny_model_dir):
    out, _ = trained
    recs = _metrics(out)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(len(r["acc"]) == 3 and len(r["step_losses"]) == 3 for r in recs)
    first = sum(r["loss"] for r in recs[:3]) / 3
    last = sum(r["loss"] for r in recs[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert sum(recs[-1]["acc"]) > sum(recs[0]["acc"])

    seqs = load_sequences(os.path.join(out, "train_state", "sequences.json"))
    assert len(seqs) == len(PROMPTS)
    assert all(
        len(s.input_ids) - s.prompt_len == 24 for s in seqs
    )  # no EOS from this random target
    # upstream format: names, dtypes and the vocabulary maps
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} < set(
        sd
    )
    hot = select_draft_vocab(seqs, 512, cfg["vocab_size"])
    assert torch.equal(sd["d2t"] + torch.arange(512), hot) and sd["d2t"].dtype == torch.int64
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].nonzero().flatten().tolist() == hot.tolist()

    mc = ModelConfig(tiny_model_dir)
    target = get_model(mc)
    draft = load_draft_model(out, target, mc)
    assert draft.draft_vocab_size == 512 and draft.map_to_target(torch.tensor([0])) == hot[0]


def test_training_forward_equals_serving_draft_chain(trained, tiny_model_dir):
    """TTT row t at step k == serving: draft extend over rows 0..t, then k decode steps fed the
    real tokens and the draft's own hidden states (on the KV pool)."""
    out, _ = trained
    mc = ModelConfig(tiny_model_dir)
    target = get_model(mc)
    draft = load_draft_model(out, target, mc)
    seqs = load_sequences(os.path.join(out, "train_state", "sequences.json"))[:2]
    layer_ids = aux_layer_ids(draft.config, mc.num_hidden_layers)
    states = capture_target_states(target, mc, seqs, layer_ids)
    _, head = target.get_embed_and_head()
    with torch.no_grad():
        outs = ttt_unroll(draft, collate(seqs, states, "cpu", torch.float32), head, 3)
    dmc = ModelConfig(out)
    checked = 0
    for b, (seq, (aux, _)) in enumerate(zip(seqs, states, strict=True)):
        x = seq.input_ids
        for t in (0, seq.prompt_len - 1, len(x) - 5):
            h = ForwardHarness(draft, dmc)
            slot = h.new_request()
            feeds = [(x[1 : t + 2], aux[: t + 1])]
            hidden = None
            for k in range(3):
                ids, hid = feeds[0] if k == 0 else ([x[t + k + 1]], hidden)
                fb = h.build_batch([(slot, ids)])
                h.attn_backend.init_forward_metadata(fb)
                with torch.no_grad():
                    res = draft(fb.input_ids, fb.positions, fb, hid)
                hidden = res.hidden_states
                torch.testing.assert_close(
                    res.logits[0], outs[k].logits[b, t], atol=1e-4, rtol=1e-4
                )
                checked += 1
    assert checked == 18


def test_resume_after_interruption_matches_uninterrupted(
    trained, tiny_model_dir, tmp_path, monkeypatch
):
    out, prompts_path = trained
    run_dir = tmp_path / "resumed"
    os.makedirs(run_dir / "train_state")
    shutil.copy(os.path.join(out, "train_state", "sequences.json"), run_dir / "train_state")
    cfg = _config(str(run_dir), tiny_model_dir, prompts_path, save_every=20)
    real, calls = trainer_mod.ttt_unroll, []

    def crashing(*args, **kw):
        calls.append(1)
        if len(calls) > 25:
            raise KeyboardInterrupt("simulated preemption")
        return real(*args, **kw)

    monkeypatch.setattr(trainer_mod, "ttt_unroll", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg)
    monkeypatch.setattr(trainer_mod, "ttt_unroll", real)
    state = torch.load(run_dir / "train_state" / "state.pt", weights_only=False)
    assert state["step"] == 20
    run_training(TrainConfig(**{**cfg.__dict__, "resume": True}))
    a = load_file(os.path.join(out, "model.safetensors"))
    b = load_file(str(run_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_replay_greedy_decode():
    # prompt_len 2, length 10: decode starts at row 1; K = 2
    correct = torch.zeros(9, 3, dtype=torch.bool)
    correct[1] = torch.tensor([True, True, False])  # verify 1: 2 drafts + bonus -> t = 4
    correct[4] = torch.tensor([True, False, True])  # verify 2: 1 draft + bonus -> t = 6
    # verify 3 at row 6: nothing accepted -> t = 7; verify 4 at row 7: last token (bonus only)
    assert replay_greedy_decode(correct, 10, 2, 2) == (3 + 2 + 1 + 1, 4)
    assert replay_greedy_decode(torch.ones(9, 3, dtype=torch.bool), 10, 2, 3) == (7, 2)


def test_select_draft_vocab():
    seqs = [TrainingSequence([9, 9, 5, 5, 5, 7, 3, 3], 2), TrainingSequence([1, 7, 3], 1)]
    # response counts: 5 x3, 3 x3, 7 x2; prompt tokens (9, 1) not counted
    assert select_draft_vocab(seqs, 2, 20).tolist() == [3, 5]
    assert select_draft_vocab(seqs, 5, 20).tolist() == [0, 1, 3, 5, 7]
    with pytest.raises(ValueError, match="not in"):
        select_draft_vocab(seqs, 21, 20)


def test_cli(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target-model-path", "--output-dir", "--ttt-steps", "--resume", "--seed"):
        assert flag in text
    args = build_parser().parse_args(["--output-dir", "x", "--steps", "5", "--lr", "0.1"])
    assert (args.steps, args.lr, args.ttt_steps, args.resume) == (5, 0.1, 3, False)
    with pytest.raises(ValueError, match="--ttt-steps must be >= 3"):
        main(["--output-dir", str(tmp_path), "--ttt-steps", "2"])


def test_capture_with_triton_equals_torch_native(tiny_model_dir):
    """The Triton capture (the default on CUDA; here compiled on a GPU or interpreted on CPU)
    gives the torch_native capture's states, across ragged sequences and capture batches, and
    collate builds the padded batch where the states live."""
    from sglang.test.triton_interpreter import DEVICE

    mc = ModelConfig(tiny_model_dir, device=DEVICE)
    target = get_model(mc, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    lens = [7, 19, 3, 12]
    seqs = [
        TrainingSequence(torch.randint(5, mc.vocab_size, (n,), generator=gen).tolist(), 2)
        for n in lens
    ]
    kw = dict(max_batch_tokens=24, max_batch_seqs=4)  # groups [7, 3 + 12 ...]: two forwards
    layers = [-1, 0, 1]  # the tiny target has 2 layers: embedding, layer 0 and 1 outputs
    ref = capture_target_states(
        target, mc, seqs, layers, DEVICE, attention_backend="torch_native", **kw
    )
    got = capture_target_states(
        target, mc, seqs, layers, DEVICE, store_device=DEVICE, attention_backend="triton", **kw
    )
    for (ra, rf), (ga, gf), n in zip(ref, got, lens, strict=True):
        assert ra.device.type == "cpu" and ga.device.type == torch.device(DEVICE).type
        assert ga.shape == (n, 3 * mc.hf_config.hidden_size) and gf.shape == (n, rf.shape[1])
        torch.testing.assert_close(ga.cpu(), ra, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(gf.cpu(), rf, atol=2e-4, rtol=2e-4)
    batch = collate(seqs, got, DEVICE, torch.float32)
    assert batch.aux.shape == (4, 19, ga.shape[1]) and batch.input_ids[2, 3:].eq(0).all()
    assert torch.equal(batch.aux[1], got[1][0]) and batch.aux[2, 3:].eq(0).all()


def test_load_prompts_file_gzip(tmp_path):
    import gzip

    rows = [{"prompt": "one"}, {"prompt": "two\nlines"}]
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts_file(str(path)) == ["one", "two\nlines"]


def test_every_trainable_parameter_gets_a_gradient(trained, tiny_model_dir):
    """One training-time-test backward reaches every trainable draft parameter (fc included)
    and matches the CPU gradients. On CUDA this is the check that the layers' fused
    Triton kernels, which have no backward, stay out of the way when autograd records
    (needs_autograd): before that, RMSNorm ran in Triton and cut fc and the norms off."""
    from sglang.srt.layers.triton_kernels import needs_autograd
    from sglang.srt.speculative.training.draft_init import trainable_parameters
    from sglang.test.triton_interpreter import DEVICE

    out, _ = trained
    x = torch.ones(2, requires_grad=True)
    assert needs_autograd(None, x) and not needs_autograd(x.detach())
    with torch.no_grad():
        assert not needs_autograd(x)
    grads = []  # [reference, device]
    for dev in ("cpu", DEVICE):
        dtype = torch.float32  # the target too: on CUDA "auto" would load it in bf16
        mc = ModelConfig(tiny_model_dir, dtype="float32", device=dev)
        target = get_model(mc, device=dev)
        draft = load_draft_model(out, target, mc, dev).to(dtype)
        params = dict(draft.named_parameters())
        names = [n for n, p in params.items() if any(p is q for q in trainable_parameters(draft))]
        for n in names:
            params[n].requires_grad_(True)
        seqs = load_sequences(os.path.join(out, "train_state", "sequences.json"))[:2]
        layers = aux_layer_ids(draft.config, mc.num_hidden_layers)
        states = capture_target_states(target, mc, seqs, layers, dev, store_dtype=dtype)
        _, head = target.get_embed_and_head()
        outs = ttt_unroll(draft, collate(seqs, states, dev, dtype), head.to(dtype), 3)
        sum(o.loss for o in outs).backward()
        grads.append({n: params[n].grad for n in names})
    ref, got = grads
    assert any(n.startswith("fc") for n in ref)
    for n, g in got.items():
        assert g is not None and g.abs().sum() > 0, n
        torch.testing.assert_close(g.cpu(), ref[n], atol=1e-3, rtol=1e-2)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through the Triton interpreter; on CUDA the kernels compile for GPU "
    "tensors, and test_every_trainable_parameter_gets_a_gradient covers the real dispatch",
)
def test_fused_kernels_stay_out_of_training_on_cpu(trained, tiny_model_dir, monkeypatch):
    """The CUDA dispatch, on the CPU: RMSNorm and SiLU-and-mul gated as on a GPU (their Triton
    kernels run through the interpreter) unless autograd records (needs_autograd). Training
    then gets the gradients of the plain PyTorch layers; gated on the device alone, as before
    the fix, the kernels (which have no backward) cut fc and the norms off from the loss."""
    from sglang.srt.layers import activation, layernorm
    from sglang.srt.layers.triton_kernels import needs_autograd
    from sglang.srt.speculative.training.draft_init import trainable_parameters

    out, _ = trained
    mc = ModelConfig(tiny_model_dir, dtype="float32")
    target = get_model(mc)
    seqs = load_sequences(os.path.join(out, "train_state", "sequences.json"))[:2]
    _, head = target.get_embed_and_head()

    def grads() -> dict:
        draft = load_draft_model(out, target, mc)
        params = trainable_parameters(draft)
        for p in params:
            p.requires_grad_(True)
        layers = aux_layer_ids(draft.config, mc.num_hidden_layers)
        states = capture_target_states(target, mc, seqs, layers)
        outs = ttt_unroll(draft, collate(seqs, states, "cpu", torch.float32), head, 3)
        sum(o.loss for o in outs).backward()
        return {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}

    ref = grads()
    for gate, fixed in (
        (lambda t, *more: not needs_autograd(t, *more), True),
        (lambda t, *more: True, False),
    ):
        monkeypatch.setattr(layernorm, "use_triton_kernels", gate)
        monkeypatch.setattr(activation, "use_triton_kernels", gate)
        got = grads()
        cut = [n for n, g in got.items() if g is None or not g.abs().sum() > 0]
        if fixed:
            assert not cut
            for n, g in got.items():
                torch.testing.assert_close(g, ref[n])
        else:  # the gate before the fix
            assert any(n.startswith("fc") for n in cut), cut
