"""EAGLE-3 draft training (issue "draft training"): `python -m sglang.train_eagle3`.

Modules:
    data: ShareGPT first turns, self-distilled responses through sglang.Engine, draft vocabulary.
    capture: batched target passes that capture the aux hidden states and final hidden states.
    ttt: the training-time test (EAGLE-3, arXiv 2503.01840): the draft unrolled on its own
        hidden states, with the soft cross-entropy loss and per-step accuracy.
    trainer: TrainConfig, draft initialisation, the optimisation loop, checkpoint/resume.
    evaluate: greedy chain acceptance measured offline from the unrolled draft.
"""
