"""Arms read from the environment inside the C++ kernels, alternated in one process (`arms.diff` adds the reads:
HS_SCALAR_T=1 the element-by-element transpose, HS_PF=3 / 1 the oracle's next-tile prefetch into L1 / L2).
`python arms.py decode` (15 rounds of 10 oracle calls) or `python arms.py prefill ROWS` (11 rounds, one call)."""
import os
import statistics
import sys

import torch
from shapes import S, am, decode_step, make_plan, oracle_attention_batched, timed

ARMS = {"scalarT_noPF": {"HS_SCALAR_T": "1"}, "regT_noPF": {}, "regT_PF3": {"HS_PF": "3"}, "regT_PF1": {"HS_PF": "1"}}
if sys.argv[1] == "decode":
    fn, rounds, reps = decode_step()[0], 15, 10
else:
    rows, ctx = int(sys.argv[2]), 8192
    kv, table, _, seq_lens = am.paged_batch(1, ctx, S["groups"], S["dim"])
    qsl = torch.tensor([0, rows], dtype=torch.int32)
    q = torch.randn(rows, S["heads"], S["dim"])
    plan = make_plan(qsl, seq_lens, rows, q.device)

    def fn():
        oracle_attention_batched(q, kv[..., :S["dim"]], kv[..., S["dim"]:], table, qsl, seq_lens, scale=0.125,
                                 sparse_block_size=S["block"], topk=S["topk"], plan=plan)
    rounds, reps = 11, 1
res = {a: [] for a in ARMS}
for _ in range(rounds):
    for arm, env in ARMS.items():
        for key in ("HS_SCALAR_T", "HS_PF"):
            os.environ.pop(key, None)
        os.environ.update(env)
        res[arm].append(timed(fn, reps))
print({a: round(statistics.median(x), 2) for a, x in res.items()})
