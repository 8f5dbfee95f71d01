#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the whole test suite on CPU.
# Extra arguments go to every pytest run, e.g. `bash scripts/test.sh -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
# Kernel tests run Triton under its CPU interpreter (TRITON_INTERPRET=1, set by
# tests/kernels/conftest.py for the whole process); the engine tests must not
# inherit that, so the two suites run as separate pytest processes. The sm_90
# ahead-of-time kernel builds (tests/kernels_aot) need real JIT kernels, so they
# get a process of their own too.
"$VENV/bin/python" -m pytest tests --ignore=tests/kernels --ignore=tests/kernels_aot "$@"
"$VENV/bin/python" -m pytest tests/kernels "$@"
"$VENV/bin/python" -m pytest tests/kernels_aot "$@"
