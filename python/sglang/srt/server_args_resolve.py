"""Fill in ServerArgs defaults that depend on the machine and the model (upstream does this in
ServerArgs.__post_init__); validate combinations. Raises ValueError naming the flag."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from sglang.srt.layers.attention import check_backend_device
from sglang.srt.model_loader import resolve_model_path
from sglang.srt.server_args import DEFAULT_PREFILL_GRAPH_TOKENS, ServerArgs

logger = logging.getLogger(__name__)

# Largest --cuda-graph-prefill-max-tokens: each bucket's graph keeps its activations (and, on a
# speculative server, [T, 3H] hidden states) while the server runs, so longer prefills stay
# eager. (Before the buckets computed one logits row, [T, vocab] float32 logits made 4096
# cost ~4 GiB over all buckets with a 128k vocabulary.)
MAX_PREFILL_GRAPH_TOKENS = 4096


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return device


def resolve_server_args(args: ServerArgs) -> ServerArgs:
    """Return a copy of args with every default resolved."""
    a = dataclasses.replace(args)
    a.device = resolve_device(a.device)
    a.model_path = resolve_model_path(a.model_path)
    a.tokenizer_path = a.tokenizer_path or a.model_path
    a.served_model_name = a.served_model_name or args.model_path or "default"
    if not 0 < a.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {a.port}")
    if a.context_length is not None and a.context_length < 2:
        raise ValueError(f"--context-length must be >= 2, got {a.context_length}")
    if a.tokenizer_path is not None and not os.path.isdir(a.tokenizer_path):
        raise ValueError(f"--tokenizer-path {a.tokenizer_path!r} is not a directory")
    levels = ("debug", "info", "warning", "error", "critical")
    if not isinstance(a.log_level, str) or a.log_level.lower() not in levels:
        raise ValueError(f"--log-level must be one of {', '.join(levels)}, got {a.log_level!r}")
    a.log_level = a.log_level.lower()
    if a.tp_size != 1:
        raise ValueError("--tp-size: only 1 is supported in this release")
    if a.chunked_prefill_size is None:
        a.chunked_prefill_size = 8192 if a.device == "cuda" else 2048
    if a.max_running_requests is None:
        a.max_running_requests = 1024 if a.device == "cuda" else 256
    if a.max_running_requests < 1:
        raise ValueError("--max-running-requests must be >= 1")
    if a.max_total_tokens is not None and a.max_total_tokens < 16:
        raise ValueError("--max-total-tokens must be >= 16")
    if a.mem_fraction_static is not None and not 0 < a.mem_fraction_static < 1:
        raise ValueError("--mem-fraction-static must be in (0, 1)")
    resolve_speculative_args(a, bundled=args.model_path is None)
    if a.disable_overlap_schedule is None:  # overlap by default where there is a GPU to overlap
        a.disable_overlap_schedule = a.device != "cuda"
    if a.cuda_graph_bs is not None and (not a.cuda_graph_bs or min(a.cuda_graph_bs) < 1):
        raise ValueError(f"--cuda-graph-bs needs positive batch sizes, got {a.cuda_graph_bs}")
    if a.cuda_graph_max_bs is not None and a.cuda_graph_max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {a.cuda_graph_max_bs}")
    if a.cuda_graph_prefill_max_tokens is None:  # bs-1 graphs, on CUDA only
        bs1 = a.cuda_graph_bs is None or 1 in a.cuda_graph_bs
        a.cuda_graph_prefill_max_tokens = (
            DEFAULT_PREFILL_GRAPH_TOKENS if a.device == "cuda" and bs1 else 0
        )
    if a.cuda_graph_prefill_max_bs < 1:
        raise ValueError(
            f"--cuda-graph-prefill-max-bs must be >= 1, got {a.cuda_graph_prefill_max_bs}"
        )
    if not 0 <= a.cuda_graph_prefill_max_tokens <= MAX_PREFILL_GRAPH_TOKENS:
        raise ValueError(
            f"--cuda-graph-prefill-max-tokens must be in 0..{MAX_PREFILL_GRAPH_TOKENS}, "
            f"got {a.cuda_graph_prefill_max_tokens}"
        )
    if a.attention_backend is not None:
        check_backend_device(a.attention_backend, a.device)
    return a


def default_attention_backend(device: str, dtype, head_dim: int = 128) -> str:
    """--attention-backend when not given: flashinfer on CUDA when importable and the model
    runs in 16 bits with head_dim 64/128/256 (what its kernels cover), else triton;
    torch_native on CPU."""
    if device != "cuda":
        return "torch_native"
    if dtype not in (torch.float16, torch.bfloat16) or head_dim not in (64, 128, 256):
        return "triton"
    import importlib.util

    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


def resolve_speculative_args(a: ServerArgs, bundled: bool) -> None:
    """Upstream's speculative flags; this fork drafts chains (topk 1) of up to K tokens."""
    if a.speculative_algorithm is None:
        if a.speculative_adaptive:
            raise ValueError("--speculative-adaptive needs --speculative-algorithm")
        if a.speculative_adaptive_config is not None:
            raise ValueError(
                "--speculative-adaptive-config needs --speculative-algorithm and "
                "--speculative-adaptive"
            )
        if a.speculative_coupled_sampling:
            raise ValueError("--speculative-coupled-sampling needs --speculative-algorithm")
        unused = [
            "--" + name.replace("_", "-")
            for name in (
                "speculative_draft_model_path",
                "speculative_num_steps",
                "speculative_eagle_topk",
                "speculative_num_draft_tokens",
            )
            if getattr(a, name) is not None
        ]
        if unused:  # upstream ignores them too; say so instead of serving without speculation
            logger.warning(
                "%s given without --speculative-algorithm: ignored, speculation is off",
                ", ".join(unused),
            )
        return
    if a.speculative_adaptive_config is not None and not a.speculative_adaptive:
        raise ValueError("--speculative-adaptive-config needs --speculative-adaptive")
    algo = a.speculative_algorithm.upper()
    if algo not in ("EAGLE", "EAGLE3"):
        raise ValueError(
            f"--speculative-algorithm {a.speculative_algorithm!r} is not supported; "
            "choose EAGLE3 or EAGLE"
        )
    a.speculative_algorithm = algo
    if a.speculative_eagle_topk not in (None, 1):
        raise ValueError(
            f"--speculative-eagle-topk {a.speculative_eagle_topk} is not supported: this server "
            "drafts chains only (topk 1); per-request draft lengths replace tree drafting"
        )
    a.speculative_eagle_topk = 1
    if a.speculative_num_steps is None:
        a.speculative_num_steps = (
            a.speculative_num_draft_tokens - 1 if a.speculative_num_draft_tokens else 3
        )
    if a.speculative_num_steps < 1:
        raise ValueError("--speculative-num-steps must be >= 1")
    if a.speculative_num_draft_tokens is None:
        a.speculative_num_draft_tokens = a.speculative_num_steps + 1
    if a.speculative_num_draft_tokens != a.speculative_num_steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens must equal --speculative-num-steps + 1 for chains "
            f"(got {a.speculative_num_draft_tokens} and {a.speculative_num_steps})"
        )
    if a.speculative_adaptive:  # ValueError naming the flag (fixed_k also needs K)
        from sglang.srt.speculative.adaptive.registry import build_policy, parse_adaptive_config

        build_policy(parse_adaptive_config(a.speculative_adaptive_config), a.speculative_num_steps)
    if a.speculative_draft_model_path is None:
        from sglang.srt.speculative.bundled_draft import bundled_draft_path

        path = bundled_draft_path() if bundled and algo == "EAGLE3" else None
        if path is None:
            raise ValueError(
                "--speculative-draft-model-path is required (a bundled draft exists only for "
                "--speculative-algorithm EAGLE3 on the bundled SmolLM2-135M-Instruct)"
            )
        a.speculative_draft_model_path = path
