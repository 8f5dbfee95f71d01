# SPDX-License-Identifier: Apache-2.0
"""Loading the C++ CPU kernels (`csrc_triton/cpu_ext.py`) around torch's build lock.

Each test works on a copy of one built kernel in its own TORCH_EXTENSIONS_DIR
and loads it in a fresh interpreter, as an engine would.
"""

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from csrc_triton import cpu_ext

ROOT = Path(__file__).resolve().parents[2]
NAME = "token_select"  # the smallest of the kernels
LOAD = f"from csrc_triton import cpu_ext; assert cpu_ext.load({NAME!r}) is not None, 'no kernel'; print('loaded')"


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    """A private extension cache holding a copy of the built kernel; returns its build directory."""
    assert cpu_ext.load(NAME) is not None, f"the C++ CPU kernel {NAME} must build here (see csrc_triton/cpu_ext.py)"
    module = cpu_ext._module_name(NAME)
    built = cpu_ext._build_dir(module)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    shutil.copytree(built, tmp_path / module, ignore=shutil.ignore_patterns("lock", "hysparse.flock"))
    assert cpu_ext._build_dir(module) == tmp_path / module
    return tmp_path / module


def _start_load():
    return subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_a_lock_left_by_a_killed_build_is_removed_with_a_warning(ext_dir):
    (ext_dir / "lock").touch()  # what torch leaves behind when its build is killed
    proc = _start_load()
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("loading the kernel waited on a lock no process holds (torch's FileBaton never times out)")
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "loaded"
    assert "left behind by a build" in err and str(ext_dir / "lock") in err, err[-2000:]
    assert not (ext_dir / "lock").exists()


def test_a_build_in_progress_is_waited_for_not_broken(ext_dir):
    """While another process holds the build lock (a build running), its `lock` file stays and the load waits."""
    with open(ext_dir / "hysparse.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (ext_dir / "lock").touch()
        proc = _start_load()
        time.sleep(8)  # ample for a load of a built kernel (about 3 s here)
        assert proc.poll() is None, "the load did not wait for the build in progress"
        assert (ext_dir / "lock").exists(), "a live build's lock was removed"
        (ext_dir / "lock").unlink()  # the build finishes: torch removes its lock, then the OS lock goes
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "loaded"
    assert "left behind" not in err
