import sys, torch
sys.path.insert(0, "benchmarks")
import attention_micro as am
from csrc_triton.paged_batch import make_plan, bind_sparse
from csrc_triton.window import bind_window
torch.set_grad_enabled(False)
W = 128
for ctx, nr, ql in ((512, 8, 1), (8192, 8, 1), (512, 1, 512), (8192, 1, 2048), (300, 3, 100), (100, 2, 50)):
    kv, table, qsl, seq_lens = am.paged_batch(nr, ctx, 4, 64, q_len=ql, seed=2)
    n = nr * ql
    q = torch.randn(n, 12, 64)
    plan = make_plan(qsl, seq_lens, n, q.device)
    pos = plan.row_pos
    ids = (pos[:, None] - W + 1 + torch.arange(W)[None])
    ids = torch.where(ids < 0, -1, ids).to(torch.int32)[:, None, :].expand(n, 4, W).contiguous()
    sinks = torch.randn(12)
    run = bind_sparse(q, kv[..., :64], kv[..., 64:], span=1, scale=0.125, sinks=sinks)
    runw = bind_window(q, kv[..., :64], kv[..., 64:], window=W, scale=0.125, sinks=sinks)
    out = torch.full((n, 12, 64), float("nan")); out2 = torch.full((n, 12, 64), float("nan"))
    run(q, table, plan, out, ids); runw(q, table, plan, out2)
    err = (out - out2).abs().max().item()
    w, win = am.vllm_layer(nr, ctx, 12, 4, 64, q_len=ql, window=W, seed=2)
    print(ctx, nr, ql, "maxdiff", err, "ours(ids)", round(am.median_ms(lambda: run(q, table, plan, out, ids), 7, cold=True), 3),
          "ours(window_tiled)", round(am.median_ms(lambda: runw(q, table, plan, out2), 7, cold=True), 3),
          "vllm window", round(am.median_ms(win, 7, cold=True), 3), flush=True)
