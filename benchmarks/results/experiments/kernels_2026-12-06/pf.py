# Recorded experiment (benchmarks/results/experiments/kernels_2026-12-06.md); run from the repository root.
# ruff: noqa: I001, E401, E501
import sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")  # run from the repository root
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
import attention_micro as am
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
r = am.hysparse_prefill(ctx, 2048, 3)
for k, v in r.items():
    if "previous" not in k: print(f"{k}: {v:.1f}")
