#!/usr/bin/env bash
# Set up the environment, write the tiny demo HySparse checkpoint, serve it with
# `vllm serve`, answer a completion and a streamed chat request, then stop.
# Keep the server running instead with: KEEP_SERVING=1 bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
CKPT="${CKPT:-checkpoints/hysparse-tiny}"
PORT="${PORT:-8000}"
if [ ! -f "$CKPT/config.json" ]; then
  "$VENV/bin/python" -m vllm_hysparse.tools.make_checkpoint --arch hysparse --preset tiny --out "$CKPT"
fi
# What CPU vLLM needs on this kind of machine: float32 (bf16 kernels crash some
# CPUs), an explicit KV cache size (GiB) and no thread pinning on shared hosts.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
SERVE=("$VENV/bin/vllm" serve "$CKPT" --dtype float32 --port "$PORT" --max-model-len 4096)
if [ "${KEEP_SERVING:-0}" = 1 ]; then
  exec "${SERVE[@]}"
fi
LOG="$(dirname "$CKPT")/serve.log"
echo "[demo] ${SERVE[*]}  (log: $LOG)"
"${SERVE[@]}" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
if ! "$VENV/bin/python" -m vllm_hysparse.tools.demo_client --base-url "http://127.0.0.1:$PORT/v1"; then
  echo "[demo] the server did not answer; last lines of $LOG:" >&2
  tail -n 20 "$LOG" >&2
  exit 1
fi
grep -h "HySparse KV cache" "$LOG" | sed 's/.*\] /[server] /' | head -n 1
