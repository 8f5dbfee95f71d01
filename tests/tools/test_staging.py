# SPDX-License-Identifier: Apache-2.0
"""`tools.staging`: a Ctrl-C that Python swallows still stops a latched tool, and `check_replaceable`'s refusals.

Python drops a KeyboardInterrupt raised inside a finaliser or a weakref callback (CI saw one land in
importlib's module-lock callback: "Exception ignored in ... KeyboardInterrupt", and `convert` ran on to
exit 0). Each case runs in a child process whose finaliser sends itself SIGINT, so the handler raises
inside `__del__`; the same script without `latch_interrupts()` shows that the interrupt really is lost.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hysparse.tools import staging
from vllm_hysparse.tools.staging import check_replaceable, temporary_names

SCRIPT = """
import importlib.util, os, signal, sys, time
from pathlib import Path

# staging.py is standard library only: loaded from its file, the child skips the package's slow imports
spec = importlib.util.spec_from_file_location("staging", sys.argv[4])
staging = importlib.util.module_from_spec(spec)
spec.loader.exec_module(staging)
latch_interrupts, staged_output = staging.latch_interrupts, staging.staged_output

class Finaliser:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here, inside __del__, and Python reports and drops its exception

def swallow():
    Finaliser()  # collected at once
    print("ran on", flush=True)

out, when, latch = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "latch"
signal.signal(signal.SIGINT, signal.default_int_handler)
if latch:
    latch_interrupts()
if when == "before":
    swallow()
with staged_output(out) as tmp:
    (tmp / "config.json").write_text("{}")
    if when == "during":
        swallow()
print("published", flush=True)
"""


def _run(tmp_path: Path, when: str, latch: bool) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / f"{when}-{'latch' if latch else 'plain'}" / "out"
    out.parent.mkdir()
    if when == "during":
        out.mkdir()
        (out / "old.txt").write_text("old")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), when, "latch" if latch else "plain",
                           staging.__file__],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, out


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_swallowed_ctrl_c_stops_a_latched_tool(tmp_path, when):
    plain, plain_out = _run(tmp_path, when, latch=False)
    # the scenario is real: Python reports the KeyboardInterrupt, drops it, and the script publishes
    assert "Exception ignored" in plain.stderr and "KeyboardInterrupt" in plain.stderr, plain.stderr
    assert plain.returncode == 0 and "published" in plain.stdout, (plain.returncode, plain.stdout, plain.stderr)
    assert (plain_out / "config.json").is_file()

    latched, out = _run(tmp_path, when, latch=True)
    assert "ran on" in latched.stdout and "KeyboardInterrupt" in latched.stderr, (latched.stdout, latched.stderr)
    assert latched.returncode == -signal.SIGINT, (latched.returncode, latched.stderr)
    assert "published" not in latched.stdout
    assert not temporary_names(out), temporary_names(out)
    if when == "before":
        assert not out.exists()
    else:  # the old directory stays as it was
        assert sorted(p.name for p in out.iterdir()) == ["old.txt"] and (out / "old.txt").read_text() == "old"


def test_check_replaceable(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"^{afile} exists and is not a directory$"):
        check_replaceable(afile, force=True, error=ValueError)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not empty; pass --force to replace it$"):
        check_replaceable(full, force=False)
    check_replaceable(full, force=True)
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", force=False)
    check_replaceable(tmp_path / "absent", force=False)
    assert sorted(os.listdir(tmp_path)) == ["a-file", "empty", "full"]  # it only looks
