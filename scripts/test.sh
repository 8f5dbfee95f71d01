#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the test suite on CPU.
#   bash scripts/test.sh            the CI tier (what .ci/run runs)
#   bash scripts/test.sh --bench    the benchmark tier only (`-m bench`): load, soak and the PIC benchmark, and
#                                   the fp16 sm_90 AOT builds
# Other arguments go to every pytest run, e.g. `bash scripts/test.sh -x`.
# TEST_WORKERS (default 2) sets the pytest-xdist workers of the engine suite; TEST_WORKERS=0 runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=0
ARGS=()
for a in "$@"; do
    if [[ "$a" == "--bench" ]]; then BENCH=1; else ARGS+=("$a"); fi
done
bash scripts/setup_env.sh
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
# OpenMP threads sleep at once when out of work instead of spinning (libgomp spins for a while by default). The suite
# runs several processes with OpenMP pools on 2 cores (two engine workers, the kernel processes, engines they start),
# and a spinning pool takes the core another process waits for. Measured on tests/models/test_checkpoint_features.py
# beside a one-thread load: 121 s wall / 112 s user by default, 52-56 s / 46-47 s with PASSIVE. Every engine and
# server a test starts inherits it.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# This checkout's own bytecode (seconds; setup_env.sh compiles the installed packages): every test, engine and server
# process imports these modules, and with PYTHONDONTWRITEBYTECODE set none of them would write it.
"$PY" -m compileall -q -j 0 vllm_hysparse csrc_triton tests benchmarks >/dev/null 2>&1 || true
if [[ "$BENCH" == 1 ]]; then
    # Engine tests, then the AOT builds in a process of their own (never tests/kernels: its conftest sets
    # TRITON_INTERPRET for the process).
    status=0
    "$PY" -m pytest tests --ignore=tests/kernels --ignore=tests/kernels_aot -m bench "${ARGS[@]}" || status=$?
    "$PY" -m pytest tests/kernels_aot -m bench "${ARGS[@]}" || status=$?
    exit "$status"
fi
# Three pytest processes, because their environments differ: the kernel tests run Triton under its CPU
# interpreter (TRITON_INTERPRET=1, set by tests/kernels/conftest.py for the whole process), the sm_90
# ahead-of-time builds (tests/kernels_aot) need real JIT kernels, and the engine tests must inherit neither.
# They share nothing, so the two kernel processes run beside the engine suite. Each engine test mostly waits
# on one core (imports, compilation, Python-side scheduling), so the engine suite runs on TEST_WORKERS
# pytest-xdist workers, a test file per worker at a time (`--dist loadfile`: a module's engines and servers
# stay in one process and its tests keep their order; files that share a server run on one worker, by the table
# in tests/conftest.py). Files go out longest first, by tests/durations.json (tests/conftest.py orders them;
# `--no-loadscope-reorder` keeps xdist from reordering them by test count).
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/hysparse-tests.XXXXXX")"
trap 'rm -rf "$LOGS"' EXIT
"$PY" -m pytest tests/kernels --junitxml="$LOGS/kernels.xml" "${ARGS[@]}" >"$LOGS/kernels.log" 2>&1 &
KERNELS=$!
"$PY" -m pytest tests/kernels_aot --junitxml="$LOGS/aot.xml" "${ARGS[@]}" >"$LOGS/aot.log" 2>&1 &
AOT=$!
WORKERS="${TEST_WORKERS:-2}"
XDIST=()
[[ "$WORKERS" == 0 ]] || XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
status=0
"$PY" -m pytest tests --ignore=tests/kernels --ignore=tests/kernels_aot "${XDIST[@]}" --durations=25 \
    --junitxml="$LOGS/engine.xml" "${ARGS[@]}" || status=$?
for job in "kernels:$KERNELS" "aot:$AOT"; do
    name="${job%%:*}"
    rc=0
    wait "${job##*:}" || rc=$?
    echo
    echo "==================== tests/${name/aot/kernels_aot} (ran beside the engine suite; exit $rc) ===================="
    cat "$LOGS/$name.log"
    [[ "$rc" == 0 ]] || status=$rc
done
# TEST_REPORT_DIR: keep the three JUnit reports (per-test durations) there.
if [[ -n "${TEST_REPORT_DIR:-}" ]]; then mkdir -p "$TEST_REPORT_DIR" && cp "$LOGS"/*.xml "$TEST_REPORT_DIR"/ || true; fi
# One closing line for the three processes together.
"$PY" - "$LOGS"/*.xml <<'PY' || true
import sys
import xml.etree.ElementTree as ET

totals = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sys.argv[1:]:
    root = ET.parse(path).getroot()
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - failed - totals["skipped"]
print(f"\nall: {passed} passed, {failed} failed, {totals['skipped']} skipped")
PY
exit "$status"
