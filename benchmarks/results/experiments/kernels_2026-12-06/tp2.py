# Recorded experiment (benchmarks/results/experiments/kernels_2026-12-06.md); run from the repository root.
# ruff: noqa: I001, E401, E501
import sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")  # run from the repository root
torch.set_num_threads(2)
import attention_micro as am
from csrc_triton import cpu_ext
ctx, rows = 8192, 2048
kv, table, _, seq_lens = am.paged_batch(1, ctx, 1, 64, seed=1)
q = torch.randn(rows, 12, 64)
tiled, select = cpu_ext.load("oracle_tiled"), cpu_ext.load("token_select")
pos = torch.arange(ctx - rows, ctx); reqs = torch.zeros(rows, dtype=torch.long)
out = torch.empty_like(q); red = torch.empty(rows, 1, ctx); lse = torch.empty(rows, 12)
ids = torch.empty(rows, 1, 1024 + 128, dtype=torch.int32)
f1 = lambda: tiled.token_oracle_tiled(q, kv, table, reqs, pos, 0.125, False, out, red, lse)
f2 = lambda: select.token_select_reduced(red, pos, 1024, 128, ids)
f3 = lambda: tiled.oracle_tiled(q, kv, table, reqs, pos, ctx, 0, 0.125, out, torch.empty(rows, 1, 0, dtype=torch.int32), torch.empty(0), torch.empty(0), torch.empty(0))
for name, f in [("two-pass kernel", f1), ("select reduced", f2), ("attention alone", f3)]:
    print(name, round(am.median_ms(f, 3), 1))
