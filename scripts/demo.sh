#!/usr/bin/env bash
# Set up the environment, write the tiny demo HySparse checkpoint and answer a request.
# Until the vLLM model lands (issue "Serve HySparse in vLLM"), the request is
# answered by the reference model; `vllm serve` replaces it then.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
CKPT="${CKPT:-checkpoints/hysparse-tiny}"
if [ ! -f "$CKPT/config.json" ]; then
  "$VENV/bin/python" -m vllm_hysparse.tools.make_checkpoint --arch hysparse --preset tiny --out "$CKPT"
fi
"$VENV/bin/python" -m vllm_hysparse.tools.generate --model "$CKPT" \
  --prompt "def fibonacci(n):" --max-new-tokens 16
echo "[demo] served by the reference model: vllm serve support is not implemented yet (see README)."
