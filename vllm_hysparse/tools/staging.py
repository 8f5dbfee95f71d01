# SPDX-License-Identifier: Apache-2.0
"""Write an output directory through a temporary sibling, then publish it with renames.

    with staged_output(out) as tmp:
        ...write everything into tmp...
    # out is now the complete new directory

At every moment `out` is the old directory (or absent) or the complete new
one, never a half-written or half-deleted one, whatever kills the process:

- the work happens in `.<name>.tmp-XXXXXXXX` beside `out`; an exception or
  Ctrl-C (SIGINT) removes it, a SIGKILL leaves it behind under that name;
- an existing `out` (`--force`) is renamed aside to `.<name>.tmp-old-XXXXXXXX`
  before the new one is renamed into place, and only then deleted, instead of
  being deleted in place (which a kill would leave half-deleted);
- SIGINT is held back during publishing and cleanup, so Ctrl-C cannot
  interrupt them halfway; it takes effect right after;
- a tool that calls `latch_interrupts()` first thing in its `main` cannot lose
  a Ctrl-C: Python drops a KeyboardInterrupt raised inside a finaliser or a
  weakref callback (it prints "Exception ignored in ..." and runs on), so the
  handler also remembers the signal, and `staged_output` raises it again before
  it stages and before it publishes.
"""

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import uuid
from pathlib import Path

TMP_MARK = ".tmp-"

# SIGINTs received since `latch_interrupts()`; one is enough to stop every later `staged_output`.
_latched: list[int] = []


def temporary_names(out: Path) -> list[Path]:
    """Temporary directories of `out` left beside it (only a SIGKILL leaves any)."""
    out = Path(out)
    return sorted(out.parent.glob(f".{out.name}{TMP_MARK}*"))


def check_replaceable(out: Path, force: bool, error: type[Exception] = FileExistsError) -> None:
    """Refuse, with `error`, an `out` that is not a directory, or a non-empty one without `force`."""
    if out.exists() and not out.is_dir():
        raise error(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise error(f"{out} exists and is not empty; pass --force to replace it")


def _latch(signum, frame):
    _latched.append(signum)
    raise KeyboardInterrupt


def latch_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered (see the module docstring)."""
    if threading.current_thread() is threading.main_thread():
        _latched.clear()
        signal.signal(signal.SIGINT, _latch)


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a latched Ctrl-C was swallowed on its way (see the module docstring)."""
    if _latched:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_deferred():
    """Hold SIGINT back inside the block and raise KeyboardInterrupt after it, if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        if previous is _latch:
            _latched.extend(pending)
        raise KeyboardInterrupt


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _usual_permissions(tmp: Path) -> None:
    """mkdtemp makes the directory private (0700); give the checkpoint the umask's permissions."""
    mask = _umask()
    tmp.chmod(0o777 & ~mask)
    for path in tmp.rglob("*"):
        if path.is_dir():
            path.chmod(0o777 & ~mask)
        elif path.is_file():
            path.chmod(0o666 & ~mask)


def publish(tmp: Path, out: Path) -> None:
    """Replace `out` (if any) by the finished `tmp`, without ever deleting `out` in place."""
    _usual_permissions(tmp)
    with sigint_deferred():
        old = None
        if out.exists() or out.is_symlink():
            old = out.parent / f".{out.name}{TMP_MARK}old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)
            raise
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()


@contextlib.contextmanager
def staged_output(out: str | Path):
    """Yield a fresh temporary directory beside `out`; publish it as `out` when the block succeeds."""
    out = Path(out)
    raise_if_interrupted()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TMP_MARK}", dir=out.parent))
    try:
        yield tmp
        raise_if_interrupted()
        publish(tmp, out)
    finally:
        with sigint_deferred():
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
