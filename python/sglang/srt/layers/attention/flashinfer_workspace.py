"""The float workspace FlashInfer's wrappers plan into: one buffer per device shared by every
wrapper (they run one at a time on one stream), its size for CUDA-graph plans, and FlashInfer's
overflow message when a plan does not fit."""

from __future__ import annotations

import re

import torch

from sglang.srt.server_args import env_flag

# Upstream's default size, overridable with SGLANG_FLASHINFER_WORKSPACE_SIZE (bytes).
DEFAULT_WORKSPACE_BYTES = 384 << 20
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def float_workspace(device: torch.device, min_bytes: int = 0) -> torch.Tensor:
    """The device's shared float workspace, grown (a new buffer) when smaller than min_bytes;
    wrappers planned earlier keep the buffer they were given."""
    ws = _WORKSPACES.get(device)
    if ws is None or ws.numel() < min_bytes:
        size = int(env_flag("FLASHINFER_WORKSPACE_SIZE") or DEFAULT_WORKSPACE_BYTES)
        size = max(size, min_bytes)
        ws = _WORKSPACES[device] = torch.zeros(size, dtype=torch.uint8, device=device)
    return ws


def graph_workspace_bytes(
    max_num_tokens: int, num_qo_heads: int, head_dim: int, num_sms: int = 132
) -> int:
    """Float workspace a CUDA-graph plan may need. In graph mode FlashInfer sizes its split-KV
    partial outputs (float32 rows of num_qo_heads x head_dim) for the worst case: a floor set
    by the grid (SM count) plus a share per token. Measured on the H200 (132 SMs, 0.6.18,
    32 heads x 128): batch_prefill_tmp_v of 568,328,192 bytes for a 512-token verify graph and
    635,437,056 for 1536 tokens, i.e. about 32,640 + 4 x tokens rows. Estimate: 256 rows per
    SM + 8 per token, plus 64 MiB for the rest. A plan that still overflows grows the
    workspace and is retried (FlashInferAttnBackend.init_forward_metadata_capture_cuda_graph).
    """
    rows = 256 * num_sms + 8 * max_num_tokens
    return num_qo_heads * head_dim * 4 * rows + (64 << 20)


# Split-KV partial outputs (tmp_v, tmp_s) live in the float workspace; other names are buffers
# of the integer workspace, which growing the float one cannot help.
_OVERFLOW = re.compile(r"allocating memory for \S*tmp_[vs]\S* with size (\d+)")


def workspace_overflow_bytes(err: BaseException) -> int | None:
    """Bytes FlashInfer asked for when planning overflowed its workspace (its AlignedAllocator
    message), or None when err is something else."""
    m = _OVERFLOW.search(str(err)) if "Buffer overflow" in str(err) else None
    return int(m.group(1)) if m else None
