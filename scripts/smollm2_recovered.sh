#!/usr/bin/env bash
# Rebuild the recovered SmolLM2 students from the GGUF file plus the committed deltas:
#   GGUF -> dense checkpoint (scripts/smollm2.sh) -> converted HySparse / HySparse2 -> + deltas/smollm2-<arch>.
# Usage: bash scripts/smollm2_recovered.sh [hysparse|hysparse2|hysparse-15full ...]   (default: hysparse hysparse2)
# Writes $CHECKPOINTS/smollm2-<name> (the delta's base) and $CHECKPOINTS/smollm2-<name>-recovered
# for each delta deltas/smollm2-<name>; the architecture is the delta's (its base_config.json).
# (CHECKPOINTS=checkpoints by default).
# The delta refuses a base whose weights differ from the one it was trained on. Each step is skipped when its
# output is there (the base: when its config is the delta's base_config.json; the recovered checkpoint: when
# it was built from the same delta). Exits 3 without a registry.
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
  delta="deltas/smollm2-$a"
  # The plan the delta was trained on: its plan.json (a plan measured on data, recovery.plan) where it has
  # one, else the converter's default. A base converted otherwise (its config is not the delta's
  # base_config.json) is converted again.
  plan=()
  [ -f "$delta/plan.json" ] && plan=(--plan "$delta/plan.json")
  # The window is the one the delta was trained with (docs/recovery.md, "windows"): a converter option, which
  # wins over the plan's.
  window="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["swa_window"])' "$delta/base_config.json")"
  arch="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model_type"])' "$delta/base_config.json")"
  if ! cmp -s "$base/config.json" "$delta/base_config.json"; then
    "$PY" -m vllm_hysparse.tools.convert --src "$TEACHER" --dst "$base" --arch "$arch" "${plan[@]}" \
      --swa-window "$window" --force
  fi
  out="$CHECKPOINTS/smollm2-$a-recovered"
  # Rebuilt only when the committed delta changed since the last build (its digest beside the checkpoint).
  digest="$(sha256sum "$delta/delta.safetensors" | cut -d' ' -f1)"
  if [ -f "$out/config.json" ] && [ "$(cat "$out.delta-sha256" 2>/dev/null)" = "$digest" ]; then
    echo "[smollm2] $out is up to date with $delta"
    continue
  fi
  "$PY" -m vllm_hysparse.recovery apply --base "$base" --delta "$delta" --out "$out" --force
  echo "$digest" >"$out.delta-sha256"
done
