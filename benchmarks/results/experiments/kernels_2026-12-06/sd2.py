# Recorded experiment (benchmarks/results/experiments/kernels_2026-12-06.md); run from the repository root.
# ruff: noqa: I001, E401, E501
import sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
torch.set_num_threads(int(sys.argv[2]))
import attention_micro as am
from csrc_triton.token_oracle.batched import token_oracle_attention_batched
from csrc_triton.paged_batch import make_plan
am.SHARED_PREFIX = True
ctx = int(sys.argv[1]); s = am.HYSPARSE2
kv, table, qsl, seq_lens = am.paged_batch(8, ctx, 1, 64, seed=1)
q = torch.randn(8, 12, 64)
plan = make_plan(qsl, seq_lens, 8, q.device)
args = (q, kv[..., :64], kv[..., 64:], table, qsl, seq_lens)
kw = dict(scale=0.125, topk_tokens=1024, recent_window=128, plan=plan)
print("token_oracle", round(am.median_ms(lambda: token_oracle_attention_batched(*args, **kw), 7), 2), "dense", round(am.vllm_dense(8, ctx, 12, 1, 64, 7), 2))
