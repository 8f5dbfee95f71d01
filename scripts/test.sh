#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k oracle`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
exec "$VENV/bin/python" -m pytest tests "$@"
