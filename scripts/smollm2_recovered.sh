#!/usr/bin/env bash
# Rebuild the recovered SmolLM2 students from the GGUF file plus the committed deltas:
#   GGUF -> dense checkpoint (scripts/smollm2.sh) -> converted HySparse / HySparse2 -> + deltas/smollm2-<arch>.
# Usage: bash scripts/smollm2_recovered.sh [hysparse|hysparse2 ...]   (default: both)
# Writes $CHECKPOINTS/smollm2-<arch> (the delta's base) and $CHECKPOINTS/smollm2-<arch>-recovered
# (CHECKPOINTS=checkpoints by default).
# The delta refuses a base whose weights differ from the one it was trained on. Each step is skipped when its
# output is there (the recovered checkpoint: when it was built from the same delta). Exits 3 without a registry.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
CHECKPOINTS="${CHECKPOINTS:-checkpoints}"
TEACHER="${TEACHER:-$CHECKPOINTS/smollm2-135m-instruct}"
[ -x "$PY" ] || bash scripts/setup_env.sh
ASK=0 CKPT="$TEACHER" bash scripts/smollm2.sh
ARCHS=("$@")
[ ${#ARCHS[@]} -gt 0 ] || ARCHS=(hysparse hysparse2)
for a in "${ARCHS[@]}"; do
  base="$CHECKPOINTS/smollm2-$a"
  # The converter's default plan for this architecture: the one the deltas were trained on.
  [ -f "$base/config.json" ] || "$PY" -m vllm_hysparse.tools.convert --src "$TEACHER" --dst "$base" --arch "$a"
  out="$CHECKPOINTS/smollm2-$a-recovered"
  # Rebuilt only when the committed delta changed since the last build (its digest beside the checkpoint).
  digest="$(sha256sum "deltas/smollm2-$a/delta.safetensors" | cut -d' ' -f1)"
  if [ -f "$out/config.json" ] && [ "$(cat "$out.delta-sha256" 2>/dev/null)" = "$digest" ]; then
    echo "[smollm2] $out is up to date with deltas/smollm2-$a"
    continue
  fi
  "$PY" -m vllm_hysparse.recovery apply --base "$base" --delta "deltas/smollm2-$a" --out "$out" --force
  echo "$digest" >"$out.delta-sha256"
done
