"""Tensor-parallel linear layers (upstream names: ColumnParallelLinear, RowParallelLinear,
QKVParallelLinear, MergedColumnParallelLinear).

Each rank holds a slice of the weight; `weight_loader` receives the FULL checkpoint tensor and
copies this rank's slice. With tp_size 1 (the only size run today) the slice is everything, but
the slicing, KV-head replication and the all-reduce in RowParallelLinear are already in place.
Every forward returns (output, bias_or_None) like upstream, the bias being returned instead of
added only when skip_bias_add=True.

The matmul is `apply_linear`: F.linear, or for one row of bf16/fp16 input on CUDA a
Triton GEMV (triton_kernels/gemv.py; SGLANG_TRITON_GEMV=0 turns it off,
SGLANG_TRITON_GEMV_MAX_ROWS=2..8 sends it up to that many rows, see use_triton_gemv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.triton_kernels import use_triton_gemv


def get_tp_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group: torch.distributed's when initialized,
    else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def apply_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K], bias None or [N] -> [..., N] in
    x's dtype. When use_triton_gemv(x, weight) (CUDA, bf16/fp16, contiguous weight, 1 to
    SGLANG_TRITON_GEMV_MAX_ROWS rows: 1 by default) the Triton GEMV computes it instead, the
    bias added in fp32 before the one rounding; otherwise this is exactly F.linear."""
    if use_triton_gemv(x, weight) and (bias is None or bias.dtype == x.dtype):
        from sglang.srt.layers.triton_kernels.gemv import gemv

        out = gemv(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _resolve_tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    rank, size = get_tp_rank_and_size()
    return (rank if tp_rank is None else tp_rank), (size if tp_size is None else tp_size)


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _make_param(shape: tuple[int, ...], dtype: torch.dtype | None, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{what}: checkpoint slice has shape {tuple(loaded.shape)}, "
            f"parameter expects {tuple(param.shape)}"
        )


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along the output dim: rank r holds rows
    [r * out/tp, (r+1) * out/tp). weight: [output_size / tp, input_size]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: object | None = None,
        prefix: str = "",
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("quantized linear layers are not supported")
        self.tp_rank, self.tp_size = _resolve_tp(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.prefix = prefix
        shape = (self.output_size_per_partition, input_size)
        self.weight = _make_param(shape, params_dtype, self.weight_loader)
        if bias:
            self.bias = _make_param(
                (self.output_size_per_partition,), params_dtype, self.weight_loader
            )
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's output rows of the full tensor ([output_size, ...]) into `param`."""
        rows = param.shape[0]
        shard = loaded_weight.narrow(0, self.tp_rank * rows, rows)
        _check_shape(param, shard, self.prefix or "ColumnParallelLinear")
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [T, input_size] -> ([T, output_size / tp] (or full if gather_output), bias)."""
        bias = None if self.skip_bias_add else self.bias
        out = apply_linear(x, self.weight, bias)
        if self.gather_output and self.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, out)
            out = torch.cat(parts, dim=-1)
        return out, (self.bias if self.skip_bias_add else None)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g.
    gate_proj and up_proj). Each rank holds its slice of every sub-projection, concatenated:
    weight: [sum(output_sizes) / tp, input_size]. Shard ids are 0, 1, ... in `output_sizes` order.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, **kw) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, **kw)
        for size in self.output_sizes:
            _divide(size, self.tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        """Copy sub-projection `loaded_shard_id` (full tensor [output_sizes[id], ...]) into its
        place; with shard id None the tensor is the already-fused [sum(output_sizes), ...]."""
        if loaded_shard_id is None:
            for i, size in enumerate(self.output_sizes):
                offset = sum(self.output_sizes[:i])
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), i)
            return
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        src = loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size)
        dst = param.data.narrow(0, offset, shard_size)
        _check_shape(dst, src, f"{self.prefix or 'MergedColumnParallelLinear'}[{loaded_shard_id}]")
        dst.copy_(src)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads are split across ranks; KV heads too when
    tp_size <= total_num_kv_heads, else each KV head is replicated on tp_size / num_kv ranks.
    weight: [(heads + 2 * kv_heads) * head_size, hidden_size] per rank, laid out [q | k | v].
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        **kw,
    ) -> None:
        tp_rank, tp_size = _resolve_tp(kw.pop("tp_rank", None), kw.pop("tp_size", None))
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(
            hidden_size, output_size, bias=bias, tp_rank=tp_rank, tp_size=tp_size, **kw
        )
        self.q_size = self.num_heads * head_size  # per rank
        self.kv_size = self.num_kv_heads * head_size  # per rank

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        """Copy q_proj / k_proj / v_proj (shard id 'q' | 'k' | 'v', full checkpoint tensors with
        heads along dim 0) into this rank's slice; shard id None means an already-fused qkv."""
        if loaded_shard_id is None:
            q_total = self.total_num_heads * self.head_size
            kv_total = self.total_num_kv_heads * self.head_size
            for sid, offset, size in (
                ("q", 0, q_total),
                ("k", q_total, kv_total),
                ("v", q_total + kv_total, kv_total),
            ):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), sid)
            return
        if loaded_shard_id == "q":
            offset, size, head_rank = 0, self.q_size, self.tp_rank
        elif loaded_shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if loaded_shard_id == "v" else 0)
            size = self.kv_size
            head_rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(
                f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {loaded_shard_id!r}"
            )
        src = loaded_weight.narrow(0, head_rank * size, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, src, f"{self.prefix or 'QKVParallelLinear'}[{loaded_shard_id}]")
        dst.copy_(src)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along the input dim: rank r holds columns
    [r * in/tp, (r+1) * in/tp) and the partial outputs are summed by an all-reduce.
    weight: [output_size, input_size / tp]; the bias is added once, after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
        quant_config: object | None = None,
        prefix: str = "",
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("quantized linear layers are not supported")
        self.tp_rank, self.tp_size = _resolve_tp(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.skip_bias_add = skip_bias_add
        self.prefix = prefix
        shape = (output_size, self.input_size_per_partition)
        self.weight = _make_param(shape, params_dtype, self.weight_loader)
        if bias:
            self.bias = _make_param((output_size,), params_dtype, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Weight: copy this rank's input columns of [output_size, input_size]; bias: all of it."""
        if param.dim() == 2:
            cols = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * cols, cols)
        _check_shape(param, loaded_weight, self.prefix or "RowParallelLinear")
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [T, input_size / tp] (or [T, input_size] if not input_is_parallel) ->
        ([T, output_size], bias)."""
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        out = apply_linear(x, self.weight)
        if self.reduce_results and self.tp_size > 1:
            torch.distributed.all_reduce(out)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        return out, (self.bias if self.skip_bias_add else None)
