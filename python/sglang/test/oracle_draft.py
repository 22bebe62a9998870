"""An oracle draft for speculative-decoding tests: EAGLEWorkerV2._pick patched to propose, at
each output position, the token a reference run committed there (optionally a wrong one at every
`wrong_every`-th position), with a one-hot draft distribution. The tiny random EAGLE-3 draft of
the tests agrees with the tiny target almost never; this one is accepted as often as wanted.
A request is told apart by its sampling seed (Req.seed)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2


def install_oracle_pick(
    monkeypatch: pytest.MonkeyPatch, by_seed: dict[int, list[int]], wrong_every: int | None
) -> None:
    """Patch EAGLEWorkerV2._pick (undone by monkeypatch). by_seed: seed -> the reference run's
    output ids of that request; a position past them proposes token 0. wrong_every: positions
    p with p % wrong_every == wrong_every - 1 propose (reference + 1) % vocab instead (None:
    always right)."""

    def pick(self, logits, active, step, info, q_rows):
        seeds = info.seeds[active].tolist()
        pos = (info.random_positions[active] + (step - 1)).tolist()
        toks = []
        for s, p in zip(seeds, pos, strict=True):
            ref = by_seed[s]
            t = ref[p] if p < len(ref) else 0
            if wrong_every is not None and p % wrong_every == wrong_every - 1:
                t = (t + 1) % self.vocab_size
            toks.append(t)
        tok = torch.tensor(toks, dtype=torch.int64, device=logits.device)
        q = torch.nn.functional.one_hot(tok, self.vocab_size).float()
        for k, i in enumerate(active):
            q_rows[i].append(q[k])
        return tok

    monkeypatch.setattr(EAGLEWorkerV2, "_pick", pick)
