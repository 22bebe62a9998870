#!/usr/bin/env bash
# First call of a GPU session after staging (see scripts/gpu_run_tests.sh for staging): the
# CUDA-only tests of the fast path plus the engine/speculation tests on CUDA, logging to $OUT,
# and the FlashInfer JIT cache packed into $OUT/flashinfer_cache.tgz for the next session.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD/python:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-validate-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
[ -f .device/fi_cache.tgz ] && mkdir -p ~/.cache && tar xzf .device/fi_cache.tgz -C ~/.cache
# Triton's compiled kernels (first start of a server compiles ~10-20 s of them)
[ -f .device/triton_cache.tgz ] && mkdir -p ~/.triton && tar xzf .device/triton_cache.tgz -C ~/.triton
tests=${TESTS:-"test/srt/test_cuda_graph_runner.py test/srt/test_flashinfer_backend.py \
  test/srt/test_fused_sampling.py test/srt/test_fused_kernels.py test/srt/test_triton_attention.py"}
timeout ${TEST_TIMEOUT:-400} python3 -m pytest $tests -q -p no:cacheprovider --timeout 300 -rs \
  2>&1 | tee "$OUT/pytest_fastpath.log" | tail -30
[ -d ~/.cache/flashinfer ] && tar czf "$OUT/flashinfer_cache.tgz" -C ~/.cache flashinfer
[ -d ~/.triton/cache ] && tar czf "$OUT/triton_cache.tgz" -C ~/.triton cache
du -sh ~/.cache/flashinfer 2>/dev/null
