"""benchmark/check_warmup_fit.py on the CPU with the tiny target and draft: the warm-up sweep
runs (catch-up steps included), every (bs, catch-up, d) step is timed against its prediction,
and the result holds the fitted coefficients."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))

from check_warmup_fit import main  # noqa: E402

from sglang.srt.speculative.adaptive.step_time_model import FEATURES  # noqa: E402


def test_check_warmup_fit_cpu(tiny_model_dir, draft_dir, tmp_path):
    out = tmp_path / "fit.json"
    argv = [
        "--model-path", tiny_model_dir, "--draft-model-path", draft_dir, "--device", "cpu",
        "--dtype", "float32", "--speculative-num-steps", "3", "--context-len", "16",
        "--batch-sizes", "1", "3", "--catchups", "1", "8", "--cpu-batch-sizes", "1", "2",
        "--repeats", "1", "--max-total-tokens", "4096", "--result-file", str(out),
    ]  # fmt: skip
    result = main(argv)
    assert json.loads(out.read_text())["steps"] == result["steps"]
    got = {(r["bs"], r["catchup"], r["d"]) for r in result["steps"]}
    assert got == {(b, c, d) for b in (1, 3) for c in (1, 8) for d in (1, 3)}
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in result["steps"])
    assert set(result["coefficients"]) == set(FEATURES)
