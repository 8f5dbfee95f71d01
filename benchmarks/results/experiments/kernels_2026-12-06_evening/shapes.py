"""The shapes these experiments share: eight decode rows of the HySparse `small` preset on one shared 8k prompt
(`benchmarks/attention_micro.py --shared-prefix`), the oracle's own selection, the bound C++ kernels."""
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import attention_micro as am  # noqa: E402

from csrc_triton.oracle.batched import bind_oracle, oracle_attention_batched  # noqa: E402
from csrc_triton.paged_batch import bind_sparse, make_plan  # noqa: E402

am.SHARED_PREFIX = True
S = am.HYSPARSE


def timed(fn, reps=20) -> float:
    """Median ms of `reps` calls after one warm-up call."""
    return am.median_ms(fn, reps)


def decode_step(ctx: int = 8192, rows: int = 8):
    """(oracle call, block-sparse call, the oracle's selection) for `rows` decode rows on one shared prompt."""
    kv, table, qsl, seq_lens = am.paged_batch(rows, ctx, S["groups"], S["dim"])
    k, v = kv[..., :S["dim"]], kv[..., S["dim"]:]
    q = torch.randn(rows, S["heads"], S["dim"])
    plan = make_plan(qsl, seq_lens, rows, q.device)
    _, ids = oracle_attention_batched(q, k, v, table, qsl, seq_lens, scale=0.125, sparse_block_size=S["block"],
                                      topk=S["topk"], plan=plan)
    ids = ids.to(torch.int32)
    out = torch.empty_like(q)
    idx = torch.empty(rows, S["groups"], S["topk"], dtype=torch.int32)
    orun = bind_oracle(q, k, v, sparse_block_size=S["block"], topk=S["topk"], scale=0.125)
    srun = bind_sparse(q, k, v, span=S["block"], scale=0.125, sinks=torch.zeros(S["heads"]))
    return (lambda: orun(q, table, plan, out, idx)), (lambda: srun(q, table, plan, out, ids)), ids
