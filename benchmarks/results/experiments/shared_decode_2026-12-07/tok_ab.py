"""Token-oracle prefill chunk: two passes (R) against one pass with logits, calls alternating in one process, 64 MiB
written before each call (untimed).

    python tok_ab.py CONTEXT ROWS [REPS]     # from anywhere; ROWS: the last rows of one request of CONTEXT positions
"""
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402

import attention_micro as am  # noqa: E402
from csrc_triton.paged_batch import make_plan  # noqa: E402
from csrc_triton.token_oracle import batched as tb  # noqa: E402

ctx = int(sys.argv[1]); rows = int(sys.argv[2]); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 7
s = am.HYSPARSE2
kv, table, _, seq_lens = am.paged_batch(1, ctx, s["groups"], s["dim"], seed=1)
qsl = torch.tensor([0, rows], dtype=torch.int32)
q = torch.randn(rows, s["heads"], s["dim"])
plan = make_plan(qsl, seq_lens, rows, q.device)


def call(two):
    tb.PREFILL_TWO_PASS = two
    tb.ONE_PASS_MAX_KEYS = 0
    """One call: `two` sends every prefill row through the second pass (R), else through the logits."""
    return tb.token_oracle_attention_batched(q, kv[..., :s["dim"]], kv[..., s["dim"]:], table, qsl, seq_lens,
                                             scale=0.125, topk_tokens=s["topk"], recent_window=s["window"],
                                             plan=plan)


a, b = call(True), call(False)
print("outputs: max |diff|", (a[0] - b[0]).abs().max().item(), "/ ids equal", (a[1] == b[1]).float().mean().item())
evict = torch.empty(16 << 20)
t = {True: [], False: []}
for i in range(reps):
    for two in ((True, False) if i % 2 else (False, True)):
        evict.fill_(float(i))
        t0 = time.perf_counter(); call(two); t[two].append(1e3 * (time.perf_counter() - t0))
r = statistics.median(y / x for x, y in zip(t[True], t[False]))
print(f"ctx {ctx} rows {rows}: two passes"
      f" {statistics.median(t[True]):.1f} ms, one pass {statistics.median(t[False]):.1f} ms, one/two {r:.3f}")
