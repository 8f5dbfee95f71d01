# Recorded experiment (benchmarks/results/experiments/kernels_2026-12-06.md); run from the repository root.
# ruff: noqa: I001, E401, E501
import sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")  # run from the repository root
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
import attention_micro as am
from csrc_triton.oracle.batched import oracle_attention_batched
from csrc_triton.block_sparse.batched import block_sparse_attention_batched
from csrc_triton.token_sparse.batched import token_sparse_attention_batched
from csrc_triton.token_oracle.batched import token_oracle_attention_batched
from csrc_triton.paged_batch import make_plan
s = am.HYSPARSE; ctx=int(sys.argv[1]); rows=2048
out = {}
for mode in ("prefill", "decode"):
    n = 1 if mode == "prefill" else 8
    kv, table, qsl, seq_lens = am.paged_batch(n, ctx, s["groups"], s["dim"])
    if mode == "prefill":
        qsl = torch.tensor([0, rows], dtype=torch.int32); nr = rows
    else:
        nr = 8
    q = torch.randn(nr, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, nr, q.device)
    args = (q, kv[..., :64], kv[..., 64:], table, qsl, seq_lens)
    _, ids = oracle_attention_batched(*args, scale=0.125, sparse_block_size=64, topk=16, plan=plan)
    sinks = torch.zeros(12)
    f = lambda: block_sparse_attention_batched(*args, ids, scale=0.125, sparse_block_size=64, sinks=sinks, plan=plan)
    out[f"block_sparse {mode}"] = am.median_ms(f, 5)
    # HySparse2 token sparse
    s2 = am.HYSPARSE2
    kv2, table2, qsl2, seq2 = am.paged_batch(n, ctx, 1, 64, seed=1)
    if mode == "prefill": qsl2 = torch.tensor([0, rows], dtype=torch.int32)
    plan2 = make_plan(qsl2, seq2, nr, q.device)
    args2 = (q, kv2[..., :64], kv2[..., 64:], table2, qsl2, seq2)
    _, ids2 = token_oracle_attention_batched(*args2, scale=0.125, topk_tokens=1024, recent_window=128, plan=plan2)
    g = lambda: token_sparse_attention_batched(*args2, ids2, scale=0.125, sinks=sinks, plan=plan2)
    out[f"token_sparse {mode}"] = am.median_ms(g, 5)
print({k: round(v, 2) for k, v in out.items()})
