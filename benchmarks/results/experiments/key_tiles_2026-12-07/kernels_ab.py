"""A/B of two source trees of the C++ CPU kernels (`cpu_tiled.cpp`, `cpu_sparse.cpp` and their headers), calls
alternating in one process on `attention_micro`'s shapes: the oracle, the block-sparse kernel over the oracle's
blocks and the window walk, all with sinks where they take them.

    python kernels_ab.py OLD_TREE NEW_TREE CONTEXT ROWS [REPS]

Each tree is a copy of `csrc_triton/` (at least cpu_sparse.cpp, cpu_tile.h, cpu_online_softmax.h and
oracle/cpu_tiled.cpp), e.g. `/tmp/old/csrc_triton` after `git archive <rev> csrc_triton | tar -x -C /tmp/old`. ROWS
= 1: one decode row for each of 8 requests; otherwise one prefill chunk of ROWS rows of one request. SHARED=1: the
requests share their pages. Prints the median time of each side and the median of the per-pair ratios new/old.
OLD_FLAGS / NEW_FLAGS: extra compiler flags of each side (e.g. NEW_FLAGS=-mno-avx512f builds the AVX2 paths on an
AVX-512 CPU). COLD=1: 64 MiB written before each call (untimed), as `attention_micro.median_ms(cold=True)` does, so
that each call reads its pages from memory as an engine step does (twelve layers' caches evict each other).
KINDS=oracle,sparse: only those.

COLD and KINDS were added on 2026-12-07 evening (`../shared_decode_2026-12-07.md`); without them it runs as before.
"""
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[4]
COLD = os.environ.get("COLD") == "1"
KINDS = os.environ.get("KINDS", "oracle,sparse,window").split(",")
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import attention_micro as am  # noqa: E402

from csrc_triton import cpu_ext  # noqa: E402
from csrc_triton.block_sparse.batched import bind_block_sparse  # noqa: E402
from csrc_triton.oracle.batched import oracle_attention_batched  # noqa: E402
from csrc_triton.paged_batch import make_plan  # noqa: E402
from csrc_triton.window import bind_window  # noqa: E402

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
SOURCES = {"oracle_tiled": "oracle/cpu_tiled.cpp", "sparse": "cpu_sparse.cpp"}


def build(tree: Path, side: str) -> dict:
    """The `cpu_ext` namespaces of both libraries built from `tree` (build files in a folder beside each source)."""
    libs = {}
    for name, src in SOURCES.items():
        module = f"ab_{name}_{side}_{abs(hash(str(tree.resolve()))) % 10**8}"
        extra = os.environ.get(f"{side.upper()}_FLAGS", "").split()
        load(name=module, sources=[str(tree / src)], extra_cflags=FLAGS + extra, extra_ldflags=["-fopenmp"],
             build_directory=str((tree / src).parent), is_python_module=False)
        ops = getattr(torch.ops, module)
        lib = SimpleNamespace(**{op: getattr(ops, op) for op in cpu_ext._OPS[name]})
        lib.SUPPORTED_DIMS = tuple(ops.supported_dims())
        libs[name] = lib
    return libs


def main():
    old, new, ctx, rows = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 15
    am.SHARED_PREFIX = os.environ.get("SHARED") == "1"
    s = am.HYSPARSE
    kv, table, qsl, seq_lens = am.paged_batch(1 if rows > 1 else 8, ctx, s["groups"], s["dim"], q_len=rows)
    n = int(qsl[-1])
    q = torch.randn(n, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, n, q.device)
    args = (q, kv[..., :s["dim"]], kv[..., s["dim"]:], table, qsl, seq_lens)
    sinks = torch.zeros(s["heads"])
    kw = dict(scale=0.125, sparse_block_size=s["block"], topk=s["topk"], plan=plan)
    calls, outs = {}, {}
    for side, tree in (("old", old), ("new", new)):
        libs = build(tree, side)
        cpu_ext._LOADED.update(libs)
        _, ids = oracle_attention_batched(*args, **kw)
        sparse = bind_block_sparse(q, args[1], args[2], scale=0.125, sparse_block_size=s["block"], sinks=sinks)
        window = bind_window(q, args[1], args[2], scale=0.125, sinks=sinks, window=s["window"])
        out = outs[side] = {k: torch.full_like(q, float("nan")) for k in ("sparse", "window")}

        def oracle(libs=libs):
            cpu_ext._LOADED.update(libs)  # the oracle looks its kernel up per call
            return oracle_attention_batched(*args, **kw)[0]
        calls[side] = {"oracle": oracle,
                       "sparse": lambda sparse=sparse, ids=ids, out=out: sparse(q, table, plan, out["sparse"], ids),
                       "window": lambda window=window, out=out: window(q, table, plan, out["window"])}
    evict = torch.empty(16 << 20)  # 64 MiB
    for kind in KINDS:
        times = {side: [] for side in calls}
        for i in range(reps):
            for side in (("old", "new") if i % 2 else ("new", "old")):
                if COLD:
                    evict.fill_(float(i))
                t0 = time.perf_counter()
                calls[side][kind]()
                times[side].append(1e3 * (time.perf_counter() - t0))
        ratio = statistics.median(b / a for a, b in zip(times["old"], times["new"]))
        print(f"ctx {ctx} rows {rows} {kind:7s} old {statistics.median(times['old']):8.2f} ms  "
              f"new {statistics.median(times['new']):8.2f} ms  new/old {ratio:.3f}")
    for k in (k for k in ("sparse", "window") if k in KINDS):
        print(f"{k}: max |new - old| {(outs['new'][k] - outs['old'][k]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
