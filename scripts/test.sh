#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the test suite on CPU.
#   bash scripts/test.sh            the CI tier (what .ci/run runs)
#   bash scripts/test.sh --bench    the benchmark tier only: load, soak and the PIC benchmark (`-m bench`)
# Other arguments go to every pytest run, e.g. `bash scripts/test.sh -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=0
ARGS=()
for a in "$@"; do
    if [[ "$a" == "--bench" ]]; then BENCH=1; else ARGS+=("$a"); fi
done
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
if [[ "$BENCH" == 1 ]]; then
    # Engine tests only (no kernels: their conftest sets TRITON_INTERPRET for the process).
    exec "$VENV/bin/python" -m pytest tests --ignore=tests/kernels --ignore=tests/kernels_aot -m bench "${ARGS[@]}"
fi
# Kernel tests run Triton under its CPU interpreter (TRITON_INTERPRET=1, set by
# tests/kernels/conftest.py for the whole process); the engine tests must not
# inherit that, so the two suites run as separate pytest processes. The sm_90
# ahead-of-time kernel builds (tests/kernels_aot) need real JIT kernels, so they
# get a process of their own too.
"$VENV/bin/python" -m pytest tests --ignore=tests/kernels --ignore=tests/kernels_aot "${ARGS[@]}"
"$VENV/bin/python" -m pytest tests/kernels "${ARGS[@]}"
"$VENV/bin/python" -m pytest tests/kernels_aot "${ARGS[@]}"
