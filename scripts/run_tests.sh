#!/usr/bin/env bash
# The project's test command (CPU): lint, then the pytest suite. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
exec python3 -m pytest test -q --timeout 900 -p no:cacheprovider "$@"
