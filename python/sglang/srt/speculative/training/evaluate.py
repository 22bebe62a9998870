"""Offline acceptance of a draft under greedy chain speculation, from the unrolled draft.

Row t at step k of the training-time test equals the serving draft's k-th step after a verify
that ended at row t, fed the real tokens (ttt module doc). With greedy verification a draft
token is accepted while it equals the target's argmax, so on target-greedy sequences the accept
length of one verify starting at row t is 1 + the number of leading steps k < K whose draft
argmax equals the target argmax. Replaying decode from the first response token gives the
accept length (tokens per verify, bonus included) that the server would report.
"""

from __future__ import annotations

import torch

from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sglang.srt.speculative.training.capture import collate
from sglang.srt.speculative.training.data import TrainingSequence
from sglang.srt.speculative.training.ttt import ttt_unroll


def replay_greedy_decode(
    correct: torch.Tensor, length: int, prompt_len: int, num_steps: int
) -> tuple[int, int]:
    """(tokens emitted by verifies, number of verifies) for one sequence.

    correct [S, >= num_steps] bool: draft step k at row t proposes the target's token. Decode
    starts after prefill (row prompt_len - 1) and stops at the last token of the sequence.
    """
    rows = correct.tolist()
    t, emitted, verifies = prompt_len - 1, 0, 0
    while t + 2 <= length - 1:
        n = 0
        while n < num_steps and t + n + 2 <= length - 1 and rows[t][n]:
            n += 1
        emitted += min(n + 1, length - 1 - (t + 1))
        verifies += 1
        t += n + 1
    return emitted, verifies


@torch.no_grad()
def evaluate_draft(
    draft: LlamaForCausalLMEagle3,
    seqs: list[TrainingSequence],
    states: list[tuple[torch.Tensor, torch.Tensor]],
    target_head: torch.Tensor,
    num_steps: int,
    device: str | torch.device,
    dtype: torch.dtype,
    batch_size: int = 8,
) -> dict:
    """{"accept_length": tokens per verify at K = num_steps, "step_acc": [accuracy of each
    step over valid rows], "accept_length_at": {k: accept length with K = k}}."""
    per_k_emitted = [0] * (num_steps + 1)
    per_k_verifies = [0] * (num_steps + 1)
    hits = torch.zeros(num_steps)
    total = torch.zeros(num_steps)
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        batch = collate(chunk, states[start : start + batch_size], device, dtype)
        with torch.autocast(str(torch.device(device).type), dtype, enabled=dtype != torch.float32):
            outs = ttt_unroll(draft, batch, target_head, num_steps)
        correct = torch.stack([o.correct for o in outs], -1).cpu()  # [B, S, K]
        for k, o in enumerate(outs):
            hits[k] += o.correct.sum().item()
            total[k] += o.valid.sum().item()
        for i, s in enumerate(chunk):
            for k in range(1, num_steps + 1):
                e, v = replay_greedy_decode(correct[i], len(s.input_ids), s.prompt_len, k)
                per_k_emitted[k] += e
                per_k_verifies[k] += v
    at = {k: per_k_emitted[k] / max(per_k_verifies[k], 1) for k in range(1, num_steps + 1)}
    return {
        "accept_length": at[num_steps],
        "accept_length_at": at,
        "step_acc": (hits / total.clamp(min=1)).tolist(),
    }
