# SPDX-License-Identifier: Apache-2.0
"""C++ CPU kernels, compiled once per machine with `torch.utils.cpp_extension` (JIT, cached).

`scripts/setup_env.sh` builds them at install time, so an engine finds them
ready. Where no compiler is available (or `VLLM_HYSPARSE_CPU_EXT=0`), callers
get None and stay on the PyTorch path, with one warning.
Both kernels read V as wide as K (pages of `[G, page, 2D]`); a cache with
`v_head_dim != head_dim` (SPEC §2.6) never reaches them
(`paged_batch.cpu_kernel_pages`) and runs the PyTorch path.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

CPU_EXT_ENV = "VLLM_HYSPARSE_CPU_EXT"
_SOURCES = {"oracle_decode": Path(__file__).parent / "oracle" / "cpu_decode.cpp",
            "oracle_tiled": Path(__file__).parent / "oracle" / "cpu_tiled.cpp",
            "sparse": Path(__file__).parent / "cpu_sparse.cpp",
            "token_select": Path(__file__).parent / "token_oracle" / "cpu_select.cpp"}
# The ops each library registers under its own namespace (`torch.ops.<module name>`).
_OPS = {"oracle_decode": ("paged_decode",), "oracle_tiled": ("oracle_tiled", "oracle_tiled_reduced", "window_tiled"),
        "sparse": ("paged_sparse", "add_pages_touched", "write_pages"),
        "token_select": ("token_select", "token_select_probs")}
NAMES = tuple(_SOURCES)
# -ffast-math lets GCC call glibc's vector expf; -fno-finite-math-only keeps the -inf masks exact.
# -fopenmp: at::parallel_for is OpenMP in the header, and serial without it.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}
logger = logging.getLogger("vllm.hysparse")


def _build_tag(source: Path) -> str:
    """Key of a build in torch's extension cache: this CPU's flags, the source's path and the environment.

    Builds use -march=native, so no build may run on another CPU. The path
    keeps two checkouts from sharing one cache entry, and the environment
    (`sys.prefix`, torch's version) two virtual environments over one
    checkout: torch rebuilds an entry whose source path or compile flags
    changed, so they would rebuild it in turn, each waiting on the other's
    lock (and a build killed midway leaves a lock behind).
    """
    import torch

    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    key = f"{flags}\n{source.resolve()}\n{Path(sys.prefix).resolve()}\n{torch.__version__}"
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def _module_name(name: str) -> str:
    return f"hysparse_{name}_{_build_tag(_SOURCES[name])}"


def _build_dir(module: str) -> Path:
    """torch's extension cache directory of `module` (created if missing; honours TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(module, verbose=False))


def enabled() -> bool:
    """False where `VLLM_HYSPARSE_CPU_EXT` switches the C++ kernels off."""
    return os.environ.get(CPU_EXT_ENV, "1") not in ("0", "false", "False")


def _is_built(name: str) -> bool:
    """Whether torch's extension cache holds a build of `name` at least as new as its sources."""
    module = _module_name(name)
    lib = _build_dir(module) / f"{module}.so"
    headers = ("cpu_online_softmax.h", "cpu_tile.h", "cpu_gate.h")
    sources = (_SOURCES[name], *(Path(__file__).parent / h for h in headers))
    return lib.exists() and lib.stat().st_mtime >= max(s.stat().st_mtime for s in sources if s.exists())


def preload(names=NAMES) -> None:
    """Load (building where needed) the kernels `names` now: at model load, never inside a request.

    A build (once per machine, checkout and environment; 13-19 s of one core) gets one log line.
    """
    for name in names:
        with _LOCK:
            if name in _LOADED:
                continue
            if enabled() and not _is_built(name):
                logger.info("HySparse: building the C++ CPU kernel %s (once per machine, checkout and "
                            "environment)", name)
                t0 = time.perf_counter()
                _LOADED[name] = _build(name)
                logger.info("HySparse: C++ CPU kernel %s built in %.0f s", name, time.perf_counter() - t0)
            else:
                _LOADED[name] = _build(name)


def load(name: str = "oracle_decode"):
    """The compiled module `name`, or None when it cannot be built here (then the PyTorch twin runs)."""
    with _LOCK:
        if name not in _LOADED:
            _LOADED[name] = _build(name)
        return _LOADED[name]


@contextlib.contextmanager
def _exclusive_build(module: str):
    """Hold an OS lock on `module`'s build directory while torch builds or loads it; clear a stale torch lock.

    torch marks a build in progress with a `lock` file and makes every other
    process wait, with no timeout and no message, until the file is gone, so a
    build killed midway (Ctrl-C during setup, a CI job cancelled) used to hang
    the next model load for ever. Every process that builds our kernels takes
    this `flock` first, and the kernel drops it when its holder dies: whoever
    holds it finds a `lock` file only where a dead build left one.
    """
    build_dir = _build_dir(module)
    with open(build_dir / "hysparse.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("HySparse: removing %s, left behind by a build of %s that was stopped midway", stale,
                           module)
            stale.unlink(missing_ok=True)
        yield


def _build(name: str):
    if not enabled():
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load as jit_load

        # Registered as torch ops (TORCH_LIBRARY), not as a pybind11 module: the sources then need only the ATen
        # headers. With torch/extension.h each file took 47-54 s of CPU to compile, now 13-19 s (measured on the
        # 2-core machine, 151 s -> 44 s for the three), which setup, CI and the demo on a fresh machine all pay.
        module = _module_name(name)
        with _exclusive_build(module):
            jit_load(name=module, sources=[str(_SOURCES[name])], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                     is_python_module=False, verbose=False)
        namespace = getattr(torch.ops, module)
        ops = SimpleNamespace(**{op: getattr(namespace, op) for op in _OPS[name]})
        if name in ("oracle_tiled", "sparse"):
            ops.SUPPORTED_DIMS = tuple(namespace.supported_dims())
        return ops
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch path
        logger.warning("HySparse C++ CPU kernel %s unavailable (%s: %s); using the PyTorch path",
                       name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
