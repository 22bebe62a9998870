"""Training-time test (EAGLE-3, Li et al. 2025, arXiv 2503.01840, Sec. 3.2 and Fig. 6).

The draft is unrolled for K steps over a padded batch, in plain PyTorch attention. Row t of
sequence x_0 .. x_{L-1} (t = 0 .. L-2) at step k:
    token     x_{t+k+1}                     (the real token; equal to the accepted draft token)
    hidden    fc(target aux states at t) for k = 0, else the draft's own pre-norm hidden of
              row t at step k - 1 (the draft runs on its own outputs)
    position  t + k
    attends   step-0 keys of rows 0 .. t (the context a serving draft finds in its KV cache)
              and the keys of row t at steps 1 .. k (its own earlier draft steps)
    predicts  x_{t+k+2}; the loss is the cross-entropy against the target's next-token
              distribution at position t+k+1, restricted to the draft vocabulary (soft labels).
Row t at step k therefore equals serving: draft extend over rows 0 .. t, then k draft decode
steps (test_train_eagle3 checks this against LlamaForCausalLMEagle3.forward on the KV pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3


@dataclass
class TTTBatch:
    """A padded batch (pad id 0, right padding). B sequences, L = longest length."""

    input_ids: torch.Tensor  # [B, L] int64
    lengths: torch.Tensor  # [B] int64, tokens per sequence
    prompt_lens: torch.Tensor  # [B] int64, prompt tokens (loss on response tokens only)
    aux: torch.Tensor  # [B, L, 3 * target_hidden], target aux hidden states
    final: torch.Tensor  # [B, L, target_hidden], target final normed hidden states


@dataclass
class TTTStepOutput:
    logits: torch.Tensor  # [B, S, draft_vocab] float32, S = L - 1 rows
    loss: torch.Tensor  # [] float32, mean soft cross-entropy over the valid rows
    correct: torch.Tensor  # [B, S] bool: draft argmax == target argmax, on valid rows
    valid: torch.Tensor  # [B, S] bool: rows whose predicted token is a response token


def target_distributions(
    final: torch.Tensor, head: torch.Tensor, hot_ids: torch.Tensor, chunk_rows: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target next-token facts from its final hidden states [B, L, H] and lm_head [V, H]:
    (probs over the draft vocabulary [B, L, N] float32 = softmax of the logits restricted to
    hot_ids [N], argmax over the FULL vocabulary [B, L] int64). No gradients."""
    with torch.no_grad():
        flat = final.reshape(-1, final.shape[-1])
        argmax = torch.cat([(rows @ head.T).argmax(-1) for rows in flat.split(chunk_rows)]).view(
            final.shape[:2]
        )
        probs = (final @ head[hot_ids].T).float().softmax(-1)
    return probs, argmax


def _attend(q, k0, v0, diag_k, diag_v, scale) -> torch.Tensor:
    """q [B, nh, S, D]; k0/v0 [B, nh, S, D] (step-0 keys, causal); diag_k/diag_v: lists of
    [B, nh, S, D] (row t's own keys of steps 1..k). Returns [B, nh, S, D]."""
    s = q.shape[2]
    scores = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, S, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    extra = [((q * kj).sum(-1) * scale).unsqueeze(-1) for kj in diag_k]  # each [B, nh, S, 1]
    weights = torch.cat([scores, *extra], -1).float().softmax(-1).to(q.dtype)
    out = weights[..., :s] @ v0
    for j, vj in enumerate(diag_v):
        out = out + weights[..., s + j : s + j + 1] * vj
    return out


def ttt_unroll(
    draft: LlamaForCausalLMEagle3,
    batch: TTTBatch,
    target_head: torch.Tensor,
    num_steps: int,
) -> list[TTTStepOutput]:
    """Unroll the draft `num_steps` steps over `batch` (see module doc); differentiable in the
    draft's parameters. target_head: the target's lm_head weight [V, H]. The draft must have a
    draft vocabulary (d2t, t2d), possibly the full one."""
    attn = draft.midlayer.self_attn
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    bsz, seq_len = batch.input_ids.shape
    s = seq_len - 1
    dev = batch.input_ids.device
    n = draft.draft_vocab_size
    hot_ids = draft.map_to_target(torch.arange(n, device=dev))  # [N] target ids
    probs, argmax = target_distributions(batch.final, target_head, hot_ids)
    pad = torch.zeros(bsz, num_steps, dtype=torch.int64, device=dev)
    ids_ext = torch.cat([batch.input_ids, pad], 1)  # [B, L + K]
    rows = torch.arange(s, device=dev)
    max_pos = attn.rotary_emb.max_position_embeddings - 1
    hidden = draft.fc(batch.aux[:, :s])  # [B, S, H]
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    outs = []
    for step in range(num_steps):
        tokens = ids_ext[:, step + 1 : step + 1 + s]  # [B, S]
        embeds = draft.embed_tokens(tokens)
        residual = hidden
        x = torch.cat(
            [draft.midlayer.input_layernorm(embeds), draft.midlayer.hidden_norm(hidden)], -1
        )
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        pos = (rows + step).clamp(max=max_pos).repeat(bsz)  # [B * S]
        q, k = attn.rotary_emb(pos, q.reshape(bsz * s, -1), k.reshape(bsz * s, -1))
        q = q.view(bsz, s, nh, hd).transpose(1, 2)
        k = k.view(bsz, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        v = v.view(bsz, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        if step == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        o = _attend(q, k0, v0, diag_k, diag_v, hd**-0.5).transpose(1, 2).reshape(bsz, s, -1)
        o, _ = attn.o_proj(o)
        h, residual = draft.midlayer.post_attention_layernorm(o, residual)
        hidden = draft.midlayer.mlp(h) + residual  # pre-norm stream, next step's input
        logits = (draft.norm(hidden) @ draft.lm_head.weight.T).float()  # [B, S, N]
        outs.append(_step_loss(logits, probs, argmax, batch, hot_ids, draft.t2d, step))
    return outs


def _step_loss(logits, probs, argmax, batch, hot_ids, t2d, step) -> TTTStepOutput:
    s = logits.shape[1]
    idx = torch.arange(s, device=logits.device) + step + 1  # target position of each row
    valid = (idx[None] <= batch.lengths[:, None] - 2) & (
        idx[None] >= batch.prompt_lens[:, None] - 1
    )
    gather = idx.clamp(max=probs.shape[1] - 1)
    p = probs[:, gather]  # [B, S, N]
    top = argmax[:, gather]  # [B, S]
    mask = valid & t2d[top]  # SpecForge: rows whose target argmax is outside the vocab: no loss
    ce = -(p * F.log_softmax(logits, -1)).sum(-1)  # [B, S]
    loss = (ce * mask).sum() / valid.sum().clamp(min=1)
    correct = (hot_ids[logits.argmax(-1)] == top) & valid
    return TTTStepOutput(logits, loss, correct, valid)
