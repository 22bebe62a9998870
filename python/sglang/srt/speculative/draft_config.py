"""EAGLE-3 and EAGLE (v1) draft checkpoints: validation against the target, loading, and
writing (EAGLE-3 only).

EAGLE-3 format (upstream SGLang / SpecForge, see docs "EAGLE-3 checkpoints"): a directory with
config.json (architectures ["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1,
vocab_size = the target's, optional draft_vocab_size, target_hidden_size and
eagle_config.eagle_aux_hidden_state_layer_ids) and model.safetensors with unfused HF names
(fc.weight, midlayer.self_attn.q_proj.weight, ..., lm_head.weight, d2t, t2d).

EAGLE (v1/v2) format (SafeAILab/EAGLE, upstream models/llama_eagle.py): config.json of the
target's shape with architectures ["LlamaForCausalLMEagle"] and num_hidden_layers N, tensors
fc.weight [H, 2H], fc.bias, layers.{i}.* (see models/llama_eagle.py).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from sglang.srt.layers.rotary_embedding import rope_sharing
from sglang.srt.model_loader.loader import default_torch_dtype
from sglang.srt.model_loader.weight_utils import checkpoint_weights_iterator
from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
_CONFIG_ARCH = "LlamaForCausalLMEagle3"


def read_draft_config(draft_path: str) -> dict[str, Any]:
    """The draft's config.json as a dict.

    Raises:
        ValueError: the path does not exist, is not a directory, or has no config.json.
    """
    if not os.path.exists(draft_path):
        raise ValueError(f"speculative draft model path '{draft_path}' does not exist")
    cfg_path = os.path.join(draft_path, "config.json")
    if not os.path.isdir(draft_path) or not os.path.isfile(cfg_path):
        raise ValueError(f"speculative draft model path '{draft_path}' has no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        return json.load(f)


def draft_algorithm(cfg: dict[str, Any]) -> str:
    """ "EAGLE3" or "EAGLE" from the draft config's architectures.

    Raises:
        ValueError: no known EAGLE-3 / EAGLE architecture name.
    """
    archs = list(cfg.get("architectures") or [])
    if any(a in EAGLE3_ARCHS for a in archs):
        return "EAGLE3"
    if any(a in EAGLE1_ARCHS for a in archs):
        return "EAGLE"
    raise ValueError(
        f"draft architecture {archs} is not supported: expected one of "
        f"{list(EAGLE3_ARCHS + EAGLE1_ARCHS)}"
    )


def check_draft_algorithm(cfg: dict[str, Any], algorithm: str | None) -> str:
    """The draft's algorithm ("EAGLE3" / "EAGLE"); when `algorithm` (--speculative-algorithm)
    is given it must match.

    Raises:
        ValueError: see draft_algorithm, or the checkpoint is of the other algorithm.
    """
    kind = draft_algorithm(cfg)
    if algorithm is not None and algorithm.upper() != kind:
        archs = list(cfg.get("architectures") or [])
        raise ValueError(
            f"--speculative-algorithm {algorithm.upper()} does not match the draft checkpoint: "
            f"architecture {archs} is an {kind} draft; use --speculative-algorithm {kind} or "
            f"an {algorithm.upper()} draft"
        )
    return kind


def validate_draft_config(
    cfg: dict[str, Any], target_vocab: int, target_hidden: int, algorithm: str | None = None
) -> str:
    """Refuse a draft that cannot run on this target; returns its algorithm ("EAGLE3" or
    "EAGLE", see check_draft_algorithm).

    Raises:
        ValueError: unsupported architecture or one not matching `algorithm`; for EAGLE, see
            validate_eagle_config; for EAGLE-3: more than one layer, vocab_size !=
            target_vocab, target_hidden_size (or hidden_size when absent) != target_hidden,
            hidden_size != target_hidden (the embedding is shared), or draft_vocab_size
            outside [1, vocab_size]. Messages name the field and both values.
    """
    if check_draft_algorithm(cfg, algorithm) == "EAGLE":
        validate_eagle_config(cfg, target_vocab, target_hidden)
        return "EAGLE"
    layers = cfg.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"draft num_hidden_layers is {layers}; only 1 is supported")
    vocab = cfg.get("vocab_size")
    if vocab != target_vocab:
        raise ValueError(
            f"draft vocab_size ({vocab}) != target vocab_size ({target_vocab}): "
            "the draft was trained for another target"
        )
    hidden = cfg.get("hidden_size")
    field = "target_hidden_size" if cfg.get("target_hidden_size") is not None else "hidden_size"
    draft_target_hidden = cfg.get(field)
    if draft_target_hidden != target_hidden:
        raise ValueError(
            f"draft {field} ({draft_target_hidden}) != target hidden_size ({target_hidden}): "
            "the draft was trained for another target"
        )
    if hidden != target_hidden:
        raise ValueError(
            f"draft hidden_size ({hidden}) != target hidden_size ({target_hidden}): the draft "
            "shares the target's embedding, so they must be equal"
        )
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and not 1 <= draft_vocab <= vocab:
        raise ValueError(
            f"draft draft_vocab_size ({draft_vocab}) must be in [1, vocab_size ({vocab})]"
        )
    return "EAGLE3"


def validate_eagle_config(cfg: dict[str, Any], target_vocab: int, target_hidden: int) -> None:
    """Refuse an EAGLE (v1) draft that cannot run on this target.

    Raises:
        ValueError: num_hidden_layers < 1, vocab_size != target_vocab, hidden_size !=
            target_hidden (the draft reads the target's hidden states and shares its embedding
            and lm_head), or a reduced vocabulary (draft_vocab_size / hot_vocab_size).
    """
    layers = cfg.get("num_hidden_layers", 1)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"EAGLE draft num_hidden_layers is {layers}; need at least 1")
    vocab = cfg.get("vocab_size")
    if vocab != target_vocab:
        raise ValueError(
            f"draft vocab_size ({vocab}) != target vocab_size ({target_vocab}): "
            "the draft was trained for another target"
        )
    hidden = cfg.get("hidden_size")
    if hidden != target_hidden:
        raise ValueError(
            f"draft hidden_size ({hidden}) != target hidden_size ({target_hidden}): an EAGLE "
            "draft reads the target's hidden states and shares its embedding and lm_head"
        )
    for field in ("draft_vocab_size", "hot_vocab_size"):
        if cfg.get(field) is not None:
            raise ValueError(f"EAGLE draft {field} is not supported (full vocabulary only)")


def default_capture_layers(num_target_layers: int) -> list[int]:
    """Upstream default: the INPUTS of layers [2, N // 2, N - 3] (outputs of 1, N/2 - 1, N - 4)."""
    n = num_target_layers
    return [2, n // 2, n - 3]


def aux_layer_ids(draft_hf_config: Any, num_target_layers: int) -> list[int] | None:
    """eagle_config.eagle_aux_hidden_state_layer_ids (layers whose OUTPUT is captured; -1 = the
    embedding output), or None for upstream's default (see default_capture_layers).

    Raises:
        ValueError: not exactly 3 distinct ids in [-1, num_target_layers - 1], or (default) a
            target too shallow for 3 distinct default layers (needs >= 7 layers).
    """
    eagle_cfg = getattr(draft_hf_config, "eagle_config", None)
    if isinstance(draft_hf_config, dict):
        eagle_cfg = draft_hf_config.get("eagle_config")
    if isinstance(eagle_cfg, PretrainedConfig):
        eagle_cfg = eagle_cfg.to_dict()
    ids = (eagle_cfg or {}).get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    if ids is None:
        default = default_capture_layers(n)
        if len(set(default)) != 3 or min(default) < 0:
            raise ValueError(
                f"a {n}-layer target has no 3 distinct default EAGLE-3 layers {default}; set "
                "eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json"
            )
        return None
    ids = [int(i) for i in ids]
    if len(ids) != 3 or len(set(ids)) != 3 or not all(-1 <= i < n for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {ids}: need 3 distinct layer ids in [-1, {n - 1}] "
            f"for a {n}-layer target"
        )
    return ids


def build_draft_hf_config(cfg: dict[str, Any], arch: str = _CONFIG_ARCH) -> PretrainedConfig:
    """LlamaConfig (architectures [arch]) from the draft's config dict; extra fields
    (draft_vocab_size, target_hidden_size, eagle_config) are kept as attributes (absent ones
    set to None)."""
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**kw)
    config.architectures = [arch]
    for extra in ("draft_vocab_size", "target_hidden_size", "eagle_config"):
        if not hasattr(config, extra):
            setattr(config, extra, None)
    return config


def load_draft_model(
    draft_path: str,
    target_model: nn.Module,
    target_config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    algorithm: str | None = None,
) -> LlamaForCausalLMEagle3 | LlamaForCausalLMEagle:
    """Validate, build and load the EAGLE-3 or EAGLE draft in `draft_path` for `target_model`
    (chosen by the checkpoint's architecture; `algorithm`, when given, must match it).

    EAGLE-3: shares the target's embedding (and lm_head when the draft has no
    draft_vocab_size), and turns on the target's aux hidden-state capture at the draft's layers
    (target_model.set_eagle3_layers_to_capture). EAGLE: shares the target's embedding and
    lm_head, and turns aux capture off (the draft reads the target's final hidden states).
    dtype defaults to target_config.dtype. Returns the model in eval mode, requires_grad off.

    Raises:
        ValueError: see read_draft_config, validate_draft_config, aux_layer_ids; or the
            checkpoint lacks tensors (the message lists some).
    """
    cfg = read_draft_config(draft_path)
    kind = validate_draft_config(
        cfg, target_config.vocab_size, target_config.hidden_size, algorithm
    )
    layer_ids = None
    if kind == "EAGLE":
        hf_config = build_draft_hf_config(cfg, EAGLE1_ARCHS[0])
        model_cls = LlamaForCausalLMEagle
    else:
        hf_config = build_draft_hf_config(cfg)
        layer_ids = aux_layer_ids(hf_config, target_config.num_hidden_layers)
        model_cls = LlamaForCausalLMEagle3
    with default_torch_dtype(dtype or target_config.dtype), torch.device(device), rope_sharing():
        model = model_cls(hf_config)
    loaded = model.load_weights(checkpoint_weights_iterator(draft_path))
    missing = sorted(model.required_weight_names() - loaded)
    if missing:
        raise ValueError(
            f"draft checkpoint '{draft_path}' has no weights for {len(missing)} tensor(s): "
            f"{missing[:8]}"
        )
    embed, head = target_model.get_embed_and_head()
    model.set_embed_and_head(embed, head)
    if kind == "EAGLE":
        target_model.capture_aux_hidden_states = False
    else:
        target_model.set_eagle3_layers_to_capture(layer_ids)
    return model.eval().requires_grad_(False)


def eagle3_state_dict(model: LlamaForCausalLMEagle3) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names (q/k/v and gate/up unfused), on CPU.

    Leaves out the shared embedding, and lm_head when it comes from the target. Only
    tensor-parallel size 1 is supported (raises ValueError otherwise).
    """
    attn = model.midlayer.self_attn
    if attn.qkv_proj.tp_size != 1:
        raise ValueError("saving an EAGLE-3 draft needs tensor-parallel size 1")
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.startswith("embed_tokens.") or (
            model.lm_head_from_target and name.startswith("lm_head.")
        ):
            continue
        if name.endswith(".qkv_proj.weight"):
            q, k, v = t.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for part, shard in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = shard
        elif name.endswith(".gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return {n: t.detach().to("cpu").contiguous() for n, t in out.items()}


def draft_config_dict(config: PretrainedConfig | dict[str, Any]) -> dict[str, Any]:
    """config.json content in upstream's format: architectures ["LlamaForCausalLMEagle3"],
    model_type "llama", num_hidden_layers 1, and rope_theta written out even when transformers
    keeps it in rope_parameters."""
    d = dict(config) if isinstance(config, dict) else config.to_dict()
    d["architectures"] = [_CONFIG_ARCH]
    d["model_type"] = "llama"
    d["num_hidden_layers"] = 1
    rope = d.get("rope_parameters") or {}
    if "rope_theta" not in d and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    return {k: v for k, v in d.items() if v is not None or k == "draft_vocab_size"}


def save_eagle3_checkpoint(
    model_or_state_dict: LlamaForCausalLMEagle3 | dict[str, torch.Tensor],
    config: PretrainedConfig | dict[str, Any],
    out_dir: str,
) -> str:
    """Write config.json and model.safetensors (checkpoint names; a state dict is written as
    given, a model through eagle3_state_dict) into out_dir; returns out_dir."""
    from safetensors.torch import save_file

    if isinstance(model_or_state_dict, nn.Module):
        tensors = eagle3_state_dict(model_or_state_dict)
    else:
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in model_or_state_dict.items()}
    cfg = draft_config_dict(config)
    if cfg.get("draft_vocab_size") is None:
        cfg.pop("draft_vocab_size", None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
