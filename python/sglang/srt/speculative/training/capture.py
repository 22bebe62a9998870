"""Target hidden states for draft training: batched ragged forwards of our own target model
over the KV pools (ForwardHarness), capturing the three EAGLE-3 aux states and the final
normed hidden state of every token. No per-token Python loops."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.training.data import TrainingSequence
from sglang.srt.speculative.training.ttt import TTTBatch
from sglang.test.forward_harness import ForwardHarness


def _token_batches(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Consecutive index groups with at most max_tokens tokens (a longer sequence alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and (used + n > max_tokens or len(groups[-1]) >= max_seqs):
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [g for g in groups if g]


@torch.no_grad()
def capture_target_states(
    model: nn.Module,
    model_config: ModelConfig,
    seqs: list[TrainingSequence],
    layer_ids: list[int] | None,
    device: str = "cpu",
    max_batch_tokens: int = 8192,
    max_batch_seqs: int = 64,
    store_dtype: torch.dtype | None = None,
    store_device: str = "cpu",
    attention_backend: str | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (aux [L, 3 * H], final [L, H]) on store_device in store_dtype (default:
    the model dtype). layer_ids: the draft's eagle_aux_hidden_state_layer_ids (None: upstream
    default). attention_backend: None picks our Triton kernels on CUDA (the torch_native
    backend loops over requests: ~21k tokens/s on an H200) and torch_native elsewhere.
    """
    if attention_backend is None:
        attention_backend = "triton" if torch.device(device).type == "cuda" else "torch_native"
    model.set_eagle3_layers_to_capture(layer_ids)
    lengths = [len(s.input_ids) for s in seqs]
    longest = max(lengths)
    harness = ForwardHarness(
        model,
        model_config,
        max_total_tokens=max(max_batch_tokens, longest),
        max_requests=max_batch_seqs,
        device=device,
        attention_backend=attention_backend,
    )
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in _token_batches(lengths, max_batch_tokens, max_batch_seqs):
        harness.allocator.clear()
        harness.req_to_token_pool.clear()
        harness.kv_lens.clear()
        reqs = [(harness.new_request(), seqs[i].input_ids) for i in group]
        batch = harness.build_batch(reqs, capture_hidden_mode=CaptureHiddenMode.FULL)
        harness.attn_backend.init_forward_metadata(batch)
        final, aux = model.model(batch.input_ids, batch.positions, batch)  # [T, H], 3 x [T, H]
        if len(aux) != 3:
            raise ValueError(f"target captured {len(aux)} aux states, EAGLE-3 needs 3")
        aux_cat = torch.cat(aux, -1)  # [T, 3H]
        dtype = store_dtype or final.dtype
        sizes = [lengths[i] for i in group]
        for a, f in zip(aux_cat.split(sizes), final.split(sizes), strict=True):
            # views where device and dtype already match: aux_cat and final are new tensors
            # of each forward (nothing reuses them), so no copy is needed
            out.append((a.to(store_device, dtype), f.to(store_device, dtype)))
    return out


def collate(
    seqs: list[TrainingSequence],
    states: list[tuple[torch.Tensor, torch.Tensor]],
    device: str | torch.device,
    dtype: torch.dtype,
) -> TTTBatch:
    """Right-pad sequences (id 0, zero states) into a TTTBatch on `device` in `dtype` (the
    padded states are assembled where the states live: no round trip through the host when
    they are already on `device`)."""
    lengths = [len(s.input_ids) for s in seqs]
    bsz, longest = len(seqs), max(lengths)
    where = states[0][0].device
    ids = torch.zeros(bsz, longest, dtype=torch.int64)
    aux = torch.zeros(bsz, longest, states[0][0].shape[-1], dtype=dtype, device=where)
    final = torch.zeros(bsz, longest, states[0][1].shape[-1], dtype=dtype, device=where)
    for i, (s, (a, f)) in enumerate(zip(seqs, states, strict=True)):
        n = lengths[i]
        ids[i, :n] = torch.tensor(s.input_ids)
        aux[i, :n] = a
        final[i, :n] = f
    return TTTBatch(
        input_ids=ids.to(device),
        lengths=torch.tensor(lengths, device=device),
        prompt_lens=torch.tensor([s.prompt_len for s in seqs], device=device),
        aux=aux.to(device),
        final=final.to(device),
    )
