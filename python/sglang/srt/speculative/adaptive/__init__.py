"""Adaptive speculation (issue 7): per-request draft lengths chosen every decode step.

- acceptance.py: per-position acceptance estimates (server-wide prior, per request);
- step_time_model.py: linear step-time model, warm-up sweep, online correction;
- policy.py: the goodput policy (greedy marginal allocation with hysteresis);
- baselines.py: fixed K and a batch-size tier table, for comparison;
- registry.py: --speculative-adaptive-config parsing and the policy registry;
- step_timing.py: what a committed step cost (wall intervals, overhead EMA, which to time);
- drafting_report.py: drafting steps per batch-size bucket, predicted against measured;
- zero_reuse.py: when an all-zero choice is reused instead of running the policy again;
- controller.py: what SpecScheduler calls (choose, observe, info).
"""

from __future__ import annotations

from sglang.srt.speculative.adaptive.controller import AdaptiveController
from sglang.srt.speculative.adaptive.registry import AdaptiveConfig, parse_adaptive_config

__all__ = ["AdaptiveConfig", "AdaptiveController", "parse_adaptive_config"]
