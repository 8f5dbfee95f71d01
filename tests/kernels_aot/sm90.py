# SPDX-License-Identifier: Apache-2.0
"""Ahead-of-time sm_90 builds of the `csrc_triton` kernels, without a GPU.

The launchers themselves pick every launch config: `record_launches` swaps the
`@triton.jit` kernels of some modules for recorders, a launcher runs on `meta`
tensors (shapes and strides, no data, not "cpu", so it takes its GPU configs)
and each `kernel[grid](**kwargs)` call is kept. `Build.of` turns a recorded
launch into the signature the JIT would specialise it to; `build_sm90` builds
it for Hopper and reads ptxas' resource log (registers, spills) and Triton's
shared-memory size. Builds are plain data, so `start_builds` can run them in
worker processes.
"""

import concurrent.futures
import contextlib
import importlib
import importlib.util
import io
import multiprocessing
import os
import re
import shutil
from dataclasses import dataclass

import torch

# sm_90's opt-in shared memory per block (227 KiB)
SM90_MAX_SHARED = 232448
# one row per built kernel, filled by the tests and printed by conftest.py
RESULTS: list[dict] = []

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
_USED_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Launch:
    """One recorded `kernel[grid](**kwargs)` call; `kwargs` include num_warps / num_stages."""

    fn: object  # triton.runtime.JITFunction
    kwargs: dict


@dataclass(frozen=True)
class Build:
    """A launch as the JIT would compile it: hashable, picklable, and the same for identical launches."""

    module: str  # the kernel's module and name, to find it again in a worker process
    kernel: str
    signature: tuple  # (arg name, "*bf16" / "i32" / "fp32" / "constexpr") for every parameter
    constexprs: tuple  # (arg name, value)
    aligned: tuple  # indices of the parameters known to be divisible by 16
    options: tuple  # (num_warps / num_stages, value)

    @classmethod
    def of(cls, launch: Launch) -> "Build":
        """The JIT's specialisation of a launch, as `triton.runtime.jit` makes it.

        Tensors are `*<dtype>`, 16-byte aligned when their offset is (vLLM's
        allocations are); ints equal to 1 become constexprs (unit strides); ints
        divisible by 16 carry that divisibility.
        """
        fn, kwargs = launch.fn, dict(launch.kwargs)
        options = tuple((k, kwargs.pop(k)) for k in ("num_warps", "num_stages") if k in kwargs)
        signature, constexprs, aligned = [], [], []
        for i, p in enumerate(fn.params):
            v = kwargs[p.name]
            if p.is_constexpr or v is None or (type(v) is int and v == 1):
                ty = "constexpr"
                constexprs.append((p.name, v))
            elif isinstance(v, torch.Tensor):
                ty = "*" + _TYPES[v.dtype]
                if v.storage_offset() * v.element_size() % 16 == 0:
                    aligned.append(i)
            elif type(v) is int:
                ty = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    aligned.append(i)
            elif type(v) is float:
                ty = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: no JIT type for {p.name} = {v!r}")
            signature.append((p.name, ty))
        return cls(fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), tuple(aligned), options)


@dataclass(frozen=True)
class Usage:
    """ptxas' per-thread resources of one build, plus Triton's shared memory per block."""

    regs: int
    spill_stores: int
    spill_loads: int
    shared: int


def skip_reason() -> str | None:
    """Why AOT builds cannot run in this process, or None when they can."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # @triton.jit then yields interpreter functions, which have no AST to compile
        return "TRITON_INTERPRET is set: run tests/kernels_aot in its own pytest process"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        from triton.backends import backends
    except ImportError as e:
        return f"triton has no backends: {e}"
    if "nvidia" not in backends:
        return "triton has no nvidia backend"
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            tool = get_ptxas(90)
        except TypeError:
            # older triton: one ptxas for every arch
            tool = get_ptxas()
        ptxas = tool.path
    except Exception as e:  # noqa: BLE001 - any failure to locate ptxas means: nothing to build with
        return f"no ptxas for sm_90: {e}"
    if not (os.path.isfile(ptxas) or shutil.which(ptxas)):
        return f"ptxas not found at {ptxas}"
    return None


class _Recorder:
    """Stands in for a JIT kernel: `rec[grid](*args, **kwargs)` appends a Launch instead of running."""

    def __init__(self, fn, launches: list[Launch]):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            kwargs.update(zip(self.fn.arg_names, args))
            self.launches.append(Launch(self.fn, kwargs))
        return record


@contextlib.contextmanager
def record_launches(*modules):
    """Within the block, every `@triton.jit` function of `modules` only records its launches.

    The originals are back on exit, before any build: the code generator looks
    up helper functions (`attend_tile`, ...) among the module globals.
    """
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    saved = [(m, name, obj) for m in modules for name, obj in vars(m).items() if isinstance(obj, JITFunction)]
    try:
        for m, name, obj in saved:
            setattr(m, name, _Recorder(obj, launches))
        yield launches
    finally:
        for m, name, obj in saved:
            setattr(m, name, obj)


def _parse_ptxas_log(log: str, name: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` output."""
    regs, spills = _USED_REGS.search(log), _SPILLS.search(log)
    assert regs and spills, f"{name}: no ptxas resource lines in the build log:\n{log}"
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def build_sm90(build: Build) -> Usage:
    """Compiles the build for sm_90 (Hopper) and returns its resources; needs no GPU."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(build.module), build.kernel)
    src = ASTSource(fn=fn, signature=dict(build.signature), constexprs=dict(build.constexprs),
                    attrs={(i,): [["tt.divisibility", 16]] for i in build.aligned})
    log = io.StringIO()
    # the ptxas log is printed only on a real build, so never take a cached one
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(build.options))
    regs, stores, loads = _parse_ptxas_log(log.getvalue(), build.kernel)
    return Usage(regs=regs, spill_stores=stores, spill_loads=loads, shared=kernel.metadata.shared)


def start_builds(builds, pool: concurrent.futures.Executor) -> dict[Build, concurrent.futures.Future]:
    """Submits every distinct build to the pool; identical launches share one build."""
    return {b: pool.submit(build_sm90, b) for b in dict.fromkeys(builds)}


def build_pool() -> concurrent.futures.ProcessPoolExecutor:
    """One worker process per CPU (at most 8): a build is about a second of single-threaded compiling.

    Spawned, not forked: the parent has torch's threads running.
    """
    workers = max(1, min(8, len(os.sched_getaffinity(0))))
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
