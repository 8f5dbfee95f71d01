#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the whole test suite on CPU.
# Extra arguments go to both pytest runs, e.g. `bash scripts/test.sh -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
# Kernel tests run Triton under its CPU interpreter (TRITON_INTERPRET=1, set by
# tests/kernels/conftest.py for the whole process); the engine tests must not
# inherit that, so the two suites run as separate pytest processes.
"$VENV/bin/python" -m pytest tests --ignore=tests/kernels "$@"
"$VENV/bin/python" -m pytest tests/kernels "$@"
