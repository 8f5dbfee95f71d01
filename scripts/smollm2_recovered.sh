#!/usr/bin/env bash
# Rebuild the recovered SmolLM2 students from the GGUF file plus the committed deltas:
#   GGUF -> dense checkpoint (scripts/smollm2.sh) -> converted HySparse / HySparse2 -> + deltas/smollm2-<arch>.
# Usage: bash scripts/smollm2_recovered.sh [hysparse|hysparse2 ...]   (default: both)
# Writes checkpoints/smollm2-<arch> (the delta's base) and checkpoints/smollm2-<arch>-recovered.
# The delta refuses a base whose weights differ from the one it was trained on.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
TEACHER="${TEACHER:-checkpoints/smollm2-135m-instruct}"
[ -x "$PY" ] || bash scripts/setup_env.sh
ASK=0 CKPT="$TEACHER" bash scripts/smollm2.sh
ARCHS=("$@")
[ ${#ARCHS[@]} -gt 0 ] || ARCHS=(hysparse hysparse2)
for a in "${ARCHS[@]}"; do
  base="checkpoints/smollm2-$a"
  # The converter's default plan for this architecture: the one the deltas were trained on.
  [ -f "$base/config.json" ] || "$PY" -m vllm_hysparse.tools.convert --src "$TEACHER" --dst "$base" --arch "$a"
  "$PY" -m vllm_hysparse.recovery apply --base "$base" --delta "deltas/smollm2-$a" \
    --out "checkpoints/smollm2-$a-recovered" --force
done
