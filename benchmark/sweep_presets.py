"""Configurations and model presets of benchmark/sweep_serving.py.

A configuration is a name and the launch_server flags that make it; a preset is a model (its
flags), the configurations to run on it, the prompt set and the concurrency list.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from bench_server import split_env

from sglang.srt.speculative.bundled_draft import bundled_draft_path

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS_DIR = os.path.join(HERE, "configs")
SHAREGPT_BENCH = os.path.join(HERE, "data", "sharegpt_bench_conversations.json")
MTBENCH = os.path.join(HERE, "data", "mtbench_questions.jsonl")
LLAMA8B_DIR = os.path.join(CONFIGS_DIR, "llama31_8b_dummy")
LLAMA8B_DRAFT_CONFIG = os.path.join(CONFIGS_DIR, "llama31_8b_eagle3_dummy")
LLAMA8B_DRAFT_OUT = "/tmp/llama31_8b_eagle3_dummy"  # written at run time (make_dummy_eagle3_draft)
# SmolLM2-135M's config.json (as the bundled GGUF converts, in bfloat16); its tokenizer is the
# one in LLAMA8B_DIR (the same files as the GGUF's).
SMOLLM2_DUMMY_DIR = os.path.join(CONFIGS_DIR, "smollm2_dummy")

_EAGLE3 = ["--speculative-algorithm", "EAGLE3"]

# Static K: every request drafts K every step (no adaptive controller). tiers: upstream-like
# batch-size tier table ({"1": 3, "8": 2, "32": 1, "64": 0}, the registry default) at K = 3.
# adaptive: the goodput policy choosing each request's d_r in [0, 5] every step.
CONFIGS: dict[str, list[str]] = {
    "no_spec": [],
    "fixed_k1": _EAGLE3 + ["--speculative-num-steps", "1"],
    "fixed_k3": _EAGLE3 + ["--speculative-num-steps", "3"],
    "fixed_k5": _EAGLE3 + ["--speculative-num-steps", "5"],
    "tiers": _EAGLE3
    + ["--speculative-num-steps", "3", "--speculative-adaptive"]
    + ["--speculative-adaptive-config", json.dumps({"policy": "tiers"})],
    "adaptive": _EAGLE3 + ["--speculative-num-steps", "5", "--speculative-adaptive"],
}
ALL_CONFIGS = ["no_spec", "adaptive", "fixed_k1", "fixed_k3", "fixed_k5", "tiers"]
FULL_CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@dataclass
class Preset:
    """model_flags: flags of every configuration; draft_flags: added to speculative ones;
    make_draft: (config dir, output dir) of a dummy EAGLE-3 draft to generate first."""

    model_flags: list[str]
    draft_flags: list[str] = field(default_factory=list)
    make_draft: tuple[str, str] | None = None
    configs: list[str] = field(default_factory=lambda: list(ALL_CONFIGS))
    concurrency: list[int] = field(default_factory=lambda: list(FULL_CONCURRENCY))
    dataset: str = "sharegpt"
    dataset_path: str = SHAREGPT_BENCH
    chat_template: bool = False
    output_len: int = 128
    min_prompts: int = 16


def _llama8b(**kw) -> Preset:
    return Preset(
        model_flags=["--model-path", LLAMA8B_DIR, "--load-format", "dummy"]
        + ["--max-total-tokens", "400000"],
        draft_flags=["--speculative-draft-model-path", LLAMA8B_DRAFT_OUT],
        make_draft=(LLAMA8B_DRAFT_CONFIG, LLAMA8B_DRAFT_OUT),
        **kw,
    )


PRESETS: dict[str, Preset] = {
    # Bundled SmolLM2-135M-Instruct with its bundled trained EAGLE-3 draft (the default draft
    # of --speculative-algorithm EAGLE3 on the bundled model); held-out ShareGPT prompts under
    # the chat template (the draft was trained on chat-templated answers).
    "smollm2": Preset(model_flags=["--max-total-tokens", "600000"], chat_template=True),
    # Llama-3.1-8B shape, random weights, random EAGLE-3 draft: nothing is accepted, so this
    # measures what speculation costs when it cannot pay.
    "llama8b_dummy": _llama8b(min_prompts=8, output_len=64),
    # SmolLM2's shape with random weights, and the bundled draft (which accepts nothing on
    # it): the smollm2 preset's prompts, chat template and steps without the 94 MB GGUF, for
    # host-time work on a GPU host where staging the model costs most of a session's calls.
    # Its servers never draft: use it to compare plain steps, not what speculation earns.
    "smollm2_dummy": Preset(
        model_flags=["--model-path", SMOLLM2_DUMMY_DIR, "--load-format", "dummy"]
        + ["--tokenizer-path", LLAMA8B_DIR, "--max-total-tokens", "600000"],
        draft_flags=["--speculative-draft-model-path", bundled_draft_path() or ""],
        chat_template=True,
    ),
    # Issue 6, benchmark 3: the 8B-shaped dummy without speculation.
    "issue6": _llama8b(configs=["no_spec"], concurrency=[1, 4, 16, 64, 256]),
}


def config_flags(preset: Preset, name: str, extra: dict[str, list[str]]) -> list[str]:
    """launch_server flags of configuration `name` under `preset` (extra: user configs), after
    the configuration's leading NAME=VALUE words (its server's environment, split_env).

    Raises KeyError for an unknown configuration name."""
    env, flags = split_env(extra[name] if name in extra else CONFIGS[name])
    spec = "--speculative-algorithm" in flags
    words = [f"{k}={v}" for k, v in env.items()]
    return words + preset.model_flags + (preset.draft_flags if spec else []) + flags
