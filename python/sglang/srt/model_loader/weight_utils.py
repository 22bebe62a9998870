"""Reading and writing checkpoint tensors: safetensors/bin iterators, dummy init, default loader."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def checkpoint_files(model_dir: str) -> tuple[list[str], str]:
    """Weight files of an HF directory and their format ('safetensors' or 'pt').

    Raises:
        ValueError: the directory holds neither *.safetensors nor pytorch_model*.bin files.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files, "safetensors"
    files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if files:
        return files, "pt"
    raise ValueError(
        f"No weights in '{model_dir}': expected *.safetensors or pytorch_model*.bin files "
        "(use --load-format dummy for random weights)"
    )


def checkpoint_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor of the checkpoint, with a tqdm bar.

    Tensors are streamed one at a time from safetensors files (memory-mapped).
    """
    files, fmt = checkpoint_files(model_dir)
    if fmt == "safetensors":
        total = 0
        for path in files:
            with safe_open(path, framework="pt") as f:
                total += len(f.keys())
        with tqdm(
            total=total, desc=f"Loading weights ({len(files)} file(s))", unit="tensor"
        ) as bar:
            for path in files:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        yield name, f.get_tensor(name)
                        bar.update(1)
        return
    for path in tqdm(files, desc="Loading weights (.bin)", unit="file"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, casting dtype and device.

    Raises:
        ValueError: the shapes differ.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"weight shape {tuple(loaded_weight.shape)} does not match parameter "
            f"shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


# Checkpoint name fragment -> (fused parameter fragment, shard id): q/k/v into qkv_proj and
# gate/up into gate_up_proj (upstream's stacked_params_mapping for Llama-family models).
LLAMA_STACKED_PARAMS = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
LLAMA_FUSED_SHARDS = {".qkv_proj": 3, ".gate_up_proj": 2}  # shards per fused parameter


class StackedParamLoader:
    """Loads checkpoint tensors into a module's parameters, routing shards into fused ones.

    `loaded` collects the names of fully loaded parameters (a fused one counts once all its
    shards arrived); `unexpected` the checkpoint names matching no parameter. Shape mismatches
    raise ValueError (from the parameter's weight_loader).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stacked: tuple = LLAMA_STACKED_PARAMS,
        shards: dict[str, int] | None = None,
    ) -> None:
        self.params = dict(module.named_parameters())
        self.stacked = stacked
        self.shards = LLAMA_FUSED_SHARDS if shards is None else shards
        self.shards_seen: dict[str, set] = {}
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []

    def load(self, name: str, tensor: torch.Tensor, reported_name: str | None = None) -> None:
        """Load one tensor named `name` (in the module's naming)."""
        for fused, part, shard_id in self.stacked:
            if part not in name:
                continue
            fused_name = name.replace(part, fused)
            if fused_name not in self.params:
                self.unexpected.append(reported_name or name)
                return
            param = self.params[fused_name]
            param.weight_loader(param, tensor, shard_id)
            seen = self.shards_seen.setdefault(fused_name, set())
            seen.add(shard_id)
            if len(seen) == self.shards[fused]:
                self.loaded.add(fused_name)
            return
        if name not in self.params:
            self.unexpected.append(reported_name or name)
            return
        param = self.params[name]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        self.loaded.add(name)

    def warn_unexpected(self, log, what: str) -> None:
        if self.unexpected:
            log.warning(
                "%s: skipped %d unknown tensors, e.g. %s",
                what,
                len(self.unexpected),
                self.unexpected[:3],
            )


def initialize_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for --load-format dummy: uniform on [-sqrt(3) std, sqrt(3) std] (standard
    deviation `std`) for matrices and biases, 1.0 for norm weights (any 1-D parameter whose name
    contains 'norm').

    Values come from a counter-based hash (splitmix64 of (seed, parameter index, element index),
    sglang.srt.sampling.random.mix64) computed on the parameter's own device in chunks, so they
    are identical on every device and an 8B-parameter model fills in seconds on a GPU.
    """
    from sglang.srt.sampling.random import GOLDEN, mix64, to_int64_seed

    half_width = std * 3.0**0.5
    chunk = 1 << 26  # elements per hash call (bounds the int64 temporaries)
    for p_idx, (name, param) in enumerate(model.named_parameters()):
        if param.dim() == 1 and "norm" in name:
            param.data.fill_(1.0)
            continue
        flat = param.data.view(-1)
        key = mix64(torch.tensor([to_int64_seed(seed) * 1_000_003 + p_idx], device=flat.device))
        for lo in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - lo)
            idx = torch.arange(lo, lo + n, dtype=torch.int64, device=flat.device)
            x = mix64(key + (idx + 1) * GOLDEN)  # [n] int64
            u = ((x >> 40) & ((1 << 24) - 1)).to(torch.float32) * (1.0 / (1 << 24))  # [0, 1)
            flat[lo : lo + n] = ((u * 2.0 - 1.0) * half_width).to(flat.dtype)


def save_safetensors_checkpoint(
    state_dict: dict[str, torch.Tensor], path: str, tie_word_embeddings: bool
) -> None:
    """Write `state_dict` as one safetensors file in HF layout.

    With tied embeddings, lm_head.weight (a view of the embedding) is left out, as HF does.
    """
    tensors = {
        name: t.detach().to("cpu").contiguous()
        for name, t in state_dict.items()
        if not (tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, path, metadata={"format": "pt"})
