# Recorded experiment (benchmarks/results/experiments/kernels_2026-12-06.md); run from the repository root.
# ruff: noqa: I001, E401, E501
import sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")  # run from the repository root
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
import attention_micro as am
am.SHARED_PREFIX = True
ctx = int(sys.argv[1])
r = am.hysparse_roles(8, ctx, 7)
d = am.vllm_dense(8, ctx, 12, 4, 64, 7)
print({k: round(v, 2) for k, v in r.items() if "previous" not in k}, "dense", round(d, 2))
