"""Our C++ kernels bound as served (oracle, block-sparse over the oracle's blocks, window walk) and vLLM's CPU
attention, one decode row per request, median of 201 calls, warm or cold (64 MiB written before each call).
Run from the repository root:

    python .../one_row.py CONTEXT REQUESTS warm|cold
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import attention_micro as am  # noqa: E402

from csrc_triton.block_sparse.batched import bind_block_sparse  # noqa: E402
from csrc_triton.oracle.batched import bind_oracle  # noqa: E402
from csrc_triton.paged_batch import make_plan  # noqa: E402
from csrc_triton.window import bind_window  # noqa: E402


def main():
    ctx, nreq, cold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "cold"
    s = am.HYSPARSE
    kv, table, qsl, seq_lens = am.paged_batch(nreq, ctx, s["groups"], s["dim"])
    q = torch.randn(nreq, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, nreq, q.device)
    k_cache, v_cache = kv[..., :s["dim"]], kv[..., s["dim"]:]
    sinks = torch.zeros(s["heads"])
    oracle = bind_oracle(q, k_cache, v_cache, sparse_block_size=s["block"], topk=s["topk"], scale=0.125)
    ids = torch.empty(nreq, s["groups"], s["topk"], dtype=torch.int32)
    out = [torch.empty_like(q) for _ in range(3)]
    oracle(q, table, plan, out[0], ids)
    sparse = bind_block_sparse(q, k_cache, v_cache, scale=0.125, sparse_block_size=s["block"], sinks=sinks)
    window = bind_window(q, k_cache, v_cache, scale=0.125, sinks=sinks, window=s["window"])
    dense = am.vllm_layer(nreq, ctx, s["heads"], s["groups"], s["dim"])[1]
    for name, fn in [("oracle", lambda: oracle(q, table, plan, out[0], ids)),
                     ("block-sparse", lambda: sparse(q, table, plan, out[1], ids)),
                     ("window", lambda: window(q, table, plan, out[2])), ("vLLM dense", dense)]:
        us = 1e3 * am.median_ms(fn, 201, cold=cold)
        print(f"ctx {ctx} requests {nreq} {'cold' if cold else 'warm'} {name:12s} {us:8.1f} us")


if __name__ == "__main__":
    main()
