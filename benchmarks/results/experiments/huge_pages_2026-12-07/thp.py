"""Huge pages for the KV cache: our C++ kernels on a 4 KiB-page cache and on a copy of it collapsed to 2 MiB pages
(`madvise(MADV_COLLAPSE)`, Linux 6.1+), calls alternating, 64 MiB written before each. Run from the repository root:

    [SHARED=1] python benchmarks/results/experiments/huge_pages_2026-12-07/thp.py CONTEXT ROWS [REPS]

ROWS = 1: one decode row for each of 8 requests (SHARED=1: on one prompt's pages); else a prefill chunk of ROWS rows.
"""
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import attention_micro as am  # noqa: E402

from csrc_triton.block_sparse.batched import bind_block_sparse  # noqa: E402
from csrc_triton.oracle.batched import oracle_attention_batched  # noqa: E402
from csrc_triton.paged_batch import make_plan  # noqa: E402
from csrc_triton.window import bind_window  # noqa: E402

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_COLLAPSE, HUGE = 25, 2 << 20


def collapse(t: torch.Tensor):
    """madvise(MADV_COLLAPSE) over the 2 MiB-aligned part of t's memory: (return code, errno, MiB)."""
    a = t.data_ptr()
    e = a + t.numel() * t.element_size()
    a2, e2 = (a + HUGE - 1) // HUGE * HUGE, e // HUGE * HUGE
    return libc.madvise(a2, e2 - a2, MADV_COLLAPSE), ctypes.get_errno(), (e2 - a2) >> 20


def anon_huge_kb() -> str:
    return next(line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages"))


def main():
    ctx, rows = int(sys.argv[1]), int(sys.argv[2])
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 21
    am.SHARED_PREFIX = os.environ.get("SHARED") == "1"
    s = am.HYSPARSE
    kv, table, qsl, seq_lens = am.paged_batch(1 if rows > 1 else 8, ctx, s["groups"], s["dim"], q_len=rows)
    print("AnonHugePages before", anon_huge_kb(), "kB")
    kvh = kv.clone()
    print("collapse (rc, errno, MiB)", collapse(kvh), "AnonHugePages", anon_huge_kb(), "kB")
    n = int(qsl[-1])
    q = torch.randn(n, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, n, q.device)
    sinks = torch.zeros(s["heads"])
    calls = {}
    for side, cache in (("4k", kv), ("2m", kvh)):
        args = (q, cache[..., :s["dim"]], cache[..., s["dim"]:], table, qsl, seq_lens)
        kw = dict(scale=0.125, sparse_block_size=s["block"], topk=s["topk"], plan=plan)
        _, ids = oracle_attention_batched(*args, **kw)
        sparse = bind_block_sparse(q, args[1], args[2], scale=0.125, sparse_block_size=s["block"], sinks=sinks)
        window = bind_window(q, args[1], args[2], scale=0.125, sinks=sinks, window=s["window"])
        o1, o2 = torch.empty_like(q), torch.empty_like(q)
        calls[side] = {"oracle": lambda args=args, kw=kw: oracle_attention_batched(*args, **kw),
                       "sparse": lambda sparse=sparse, ids=ids, o=o1: sparse(q, table, plan, o, ids),
                       "window": lambda window=window, o=o2: window(q, table, plan, o)}
    evict = torch.zeros(16 << 20)
    for kind in ("oracle", "sparse", "window"):
        t = {side: [] for side in calls}
        for i in range(reps):
            for side in (("4k", "2m") if i % 2 else ("2m", "4k")):
                evict.add_(1.0)
                t0 = time.perf_counter()
                calls[side][kind]()
                t[side].append(1e3 * (time.perf_counter() - t0))
        ratio = statistics.median(b / a for a, b in zip(t["4k"], t["2m"]))
        print(f"ctx {ctx} rows {rows} shared {am.SHARED_PREFIX} {kind:7s} 4k {statistics.median(t['4k']):7.2f} ms  "
              f"2m {statistics.median(t['2m']):7.2f} ms  2m/4k {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
