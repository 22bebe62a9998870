"""Random-weight EAGLE-3 draft checkpoint from a config.json alone (draft loading has no
--load-format dummy: the draft always reads model.safetensors).

    python benchmark/make_dummy_eagle3_draft.py \
        --config-dir benchmark/configs/llama31_8b_eagle3_dummy \
        --out /tmp/llama31_8b_eagle3_dummy [--device cuda] [--dtype bfloat16] [--seed 0]

Writes OUT/config.json (a copy of the given one) and OUT/model.safetensors in upstream's
EAGLE-3 layout (fc, midlayer.*, norm, lm_head, d2t, t2d; no embedding, which the target
provides). Weights: normal(0, 0.02) like the engine's --load-format dummy, norm weights 1;
d2t = 0 (draft id i is target id i) and t2d marks the first draft_vocab_size target ids. Such
a draft is (almost) never right, so the benchmark it serves measures what speculation costs
when it cannot pay. Drawn on --device (seconds on a GPU for the Llama-3.1-8B-shaped draft,
~0.85 GB in bf16). Prints the output directory; reruns overwrite it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_dummy_eagle3_draft(
    config_dir: str, out_dir: str, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0
) -> str:
    """Write the random draft checkpoint into out_dir and return out_dir.

    Raises ValueError when config_dir holds no EAGLE-3 draft config (see read_draft_config).
    """
    from safetensors.torch import save_file

    from sglang.srt.model_loader.loader import default_torch_dtype
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.speculative.draft_config import (
        build_draft_hf_config,
        draft_algorithm,
        eagle3_state_dict,
        read_draft_config,
    )

    cfg = read_draft_config(config_dir)
    if draft_algorithm(cfg) != "EAGLE3":
        raise ValueError(f"{config_dir}: not an EAGLE-3 draft config")
    with default_torch_dtype(DTYPES[dtype]), torch.device(device):
        model = LlamaForCausalLMEagle3(build_draft_hf_config(cfg))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("embed_tokens"):
                continue  # not saved: the target's embedding is shared
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
        if getattr(model, "d2t", None) is not None:
            model.d2t.zero_()
            model.t2d.zero_()
            model.t2d[: model.d2t.numel()] = True
    tensors = eagle3_state_dict(model)
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(config_dir, "config.json"), os.path.join(out_dir, "config.json"))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.perf_counter()
    out = make_dummy_eagle3_draft(a.config_dir, a.out, a.device, a.dtype, a.seed)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
