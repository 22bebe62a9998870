"""How the target model's forwards ran: per step kind (prefill or decode / verify) and path
(replayed CUDA graph or eager), the steps, their tokens and the host seconds spent queueing
them (ModelRunner.forward_worker_batch, device time excluded on CUDA, where the call only
queues kernels).

Why: a speculative server whose steps never drafted launched every prefill step ~1 ms slower
than a plain one serving the same load (H100, thirty-eighth session, benchmark/README.md),
and py-spy put more of its samples in eager prefills; in process, with random prompts and no
cached prefix, the gap was 0.14 ms. These counters tell from a served run whether the
speculative server's prefills fall off the prefill graphs more often, and what each path costs
per step (they did: its one-token prefills ran eagerly, 24-33 ms each, until 34b1240,
thirty-ninth session). The serving benchmarks read them from /get_server_info (keys
``runner_<kind>_<path>_steps``, ``_tokens`` and ``_s``) before and after a point.
Cost: one time.perf_counter() pair and three dict updates per forward.
"""

from __future__ import annotations

KINDS = ("prefill", "decode")
PATHS = ("graph", "eager")


class ForwardCounters:
    """Cumulative steps, tokens and host seconds per (kind, path) since start."""

    def __init__(self) -> None:
        self.steps = {(k, p): 0 for k in KINDS for p in PATHS}
        self.tokens = dict.fromkeys(self.steps, 0)
        self.seconds = dict.fromkeys(self.steps, 0.0)

    def add(self, prefill: bool, graph: bool, num_tokens: int, seconds: float) -> None:
        """Count one forward of num_tokens tokens that took `seconds` of host time."""
        key = ("prefill" if prefill else "decode", "graph" if graph else "eager")
        self.steps[key] += 1
        self.tokens[key] += num_tokens
        self.seconds[key] += seconds

    def info(self) -> dict[str, float]:
        """{'runner_<kind>_<path>_steps' | '_tokens': int, '_s': seconds rounded to 1 us}."""
        out: dict[str, float] = {}
        for (kind, path), n in self.steps.items():
            name = f"runner_{kind}_{path}"
            out[f"{name}_steps"] = n
            out[f"{name}_tokens"] = self.tokens[kind, path]
            out[f"{name}_s"] = round(self.seconds[kind, path], 6)
        return out
