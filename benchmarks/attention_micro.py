# SPDX-License-Identifier: Apache-2.0
"""Per-layer attention microbenchmark on CPU: each HySparse role against vLLM's dense CPU attention.

    python benchmarks/attention_micro.py                     # contexts 8192 and 32768, 8 decode requests
    python benchmarks/attention_micro.py --contexts 2048 --reps 3

Two steps per context: one decode step of `--num-reqs` requests, and one prefill chunk of
`--prefill-rows` rows of one request (the last rows of the context, as chunked prefill runs them).
The HySparse oracle runs twice: the C++ tiled kernel (`csrc_triton/oracle/cpu_tiled.cpp`, the
serving path) and the previous path (C++ decode kernel or PyTorch GEMMs, selection in PyTorch),
so one run gives the before/after ratio. The HySparse2 token oracle too: the tiled kernel's logits with
the C++ selection (`csrc_triton/token_oracle/cpu_select.cpp`) for every row, and the previous path
(the one-pass C++ kernel's logits for decode rows, PyTorch GEMMs for prefill rows, selection in PyTorch).

Shapes are the `small` presets' (HySparse: 12 heads, 4 KV groups, D 64, 16 blocks of 64, a 128 window;
HySparse2: 12 heads, MQA, D 64, 1024 tokens + a 128 window). Every role runs the batched
PyTorch path that serves on CPU (`csrc_triton/*/batched.py`) on a paged cache of 128-token
pages; the baseline is vLLM's C++ CPU kernel (`cpu_attention_with_kv_cache`) on the same
context in its own cache layout, at the same KV group count (KV splitting as vLLM's `VLLM_CPU_ATTN_SPLIT_KV`,
on by default; results up to 2026-12-07_0445 ran it off). Rows `sparse layer`: a HySparse sparse layer's whole
attention as served (window K/V write, the window branch on the C++ window walk storing its gated rows, the
global branch on the C++ block-sparse kernel adding its own, both with sinks: the gate mix inside the kernels'
stores since 2026-12-07_1300; before, a mix after both kernels, timed as the faster of compiled and eager alone,
standing in for the loop vLLM's compiled forward fused it into; and with the window branch on vLLM's
sliding-window kernel, as served before 2026-12-07) against a dense layer's (K/V write and attention),
decode and prefill (a layer's attention without its projections and MLP, which `layer_breakdown.py` times in
the engine), each part alone too, all with the CPU caches evicted before each call. Also timed: the pages-per-query
counters of one oracle layer as served (`PagesPerQueryStats.add`, the C++ counter; their cost with
metrics on; before 2026-12-07 this row timed the PyTorch twin). Median of `--reps` after a warm-up.
Writes `benchmarks/results/attention_micro_<date>_<HHMM>.{json,md,png}` and prints the table.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import csrc_triton.oracle.batched as oracle_batched
import csrc_triton.token_oracle.batched as token_oracle_batched
from csrc_triton import cpu_ext
from csrc_triton.block_sparse.batched import bind_block_sparse, block_sparse_attention_batched
from csrc_triton.oracle.batched import oracle_attention_batched
from csrc_triton.paged_batch import make_plan
from csrc_triton.testing import make_paged_batch
from csrc_triton.token_oracle.batched import token_oracle_attention_batched
from csrc_triton.token_sparse.batched import token_sparse_attention_batched
from csrc_triton.window import bind_window
from vllm_hysparse.attention.paged import bind_write_kv
from vllm_hysparse.metrics import PagesPerQueryStats
from vllm_hysparse.tools.harness import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAGE = 128
HYSPARSE = dict(heads=12, groups=4, dim=64, block=64, topk=16, window=128)
HYSPARSE2 = dict(heads=12, groups=1, dim=64, topk=1024, window=128)


_EVICT = None  # 64 MiB, twice this machine's 32 MiB L3


def median_ms(fn, reps: int, cold: bool = False) -> float:
    """Median ms of `fn` over `reps` calls after a warm-up; `cold` writes over 64 MiB before each call (untimed), so
    that the call finds its cache pages and buffers outside the CPU caches, as in an engine step, where the other
    layers' weights and caches pass between two calls of one layer."""
    global _EVICT
    if cold and _EVICT is None:
        _EVICT = torch.zeros(16 << 20)
    fn()
    times = []
    for _ in range(reps):
        if cold:
            _EVICT.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


SHARED_PREFIX = False  # --shared-prefix: every request's block table points at request 0's pages


def paged_batch(num_reqs, ctx, groups, dim, seed=0, q_len=1):
    """Our logical page view `[pages, G, PAGE, 2D]` (float32, one spare NaN page), a block table `[R, pages]`
    and the step's metadata (`q_len` query rows per request, the last of its `ctx` positions): a thin view of
    `csrc_triton.testing.make_paged_batch`, drawn over the whole cache (it seeds the global RNG with `seed`).
    With `SHARED_PREFIX`, every request reads request 0's pages, as vLLM's prefix cache serves requests on one
    prompt."""
    batch = make_paged_batch([q_len] * num_reqs, [ctx] * num_reqs, num_kv_heads=groups, head_dim=dim, page_size=PAGE,
                             dtype=torch.float32, seed=seed, device="cpu", spare_pages=1, draw="whole_cache",
                             dense=False)
    table = batch.block_table[:, : -(-ctx // PAGE)].contiguous()  # without the column pointing at the spare page
    if SHARED_PREFIX:
        table = table[:1].expand_as(table).contiguous()
    return batch.kv, table, batch.query_start_loc, batch.seq_lens_t


def vllm_layer(num_reqs, ctx, heads, groups, dim, q_len=1, window=-1, seed=0, out=None):
    """vLLM's CPU attention of one layer over `ctx` keys per request (its own cache layout), `q_len` causal rows
    each, `window` (-1: none) with sinks, into `out` (a new `[n, H, D]` buffer by default): `(write, attend)`, the
    layer's K/V write of the step's new rows (`cpu_attn_reshape_and_cache`) and its attention
    (`cpu_attention_with_kv_cache`), as vLLM's `CPU_ATTN` backend runs them (vllm/v1/attention/backends/cpu_attn.py).
    The scheduler metadata is built here, once per step in vLLM's metadata builder, not per layer; KV splitting as
    vLLM's `VLLM_CPU_ATTN_SPLIT_KV`."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    kv, table, qsl, seq_lens = paged_batch(num_reqs, ctx, groups, dim, seed=seed, q_len=q_len)
    key_cache, value_cache = kv.view(kv.shape[0], groups, PAGE * 2, dim).chunk(2, dim=2)
    n = num_reqs * q_len
    q = torch.randn(n, heads, dim)
    key, value = torch.randn(n, groups, dim), torch.randn(n, groups, dim)
    pos = (seq_lens.repeat_interleave(q_len) - q_len + torch.arange(q_len).repeat(num_reqs)).long()
    req = torch.arange(num_reqs).repeat_interleave(q_len)
    slots = table[req, pos // PAGE].long() * PAGE + pos % PAGE
    out = torch.empty_like(q) if out is None else out
    sinks = torch.zeros(heads) if window > 0 else None
    isa = _get_attn_isa(torch.float32, PAGE, dim)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs, heads, groups, dim, seq_lens, torch.float32, qsl, True, window,
                                               isa, envs.VLLM_CPU_ATTN_SPLIT_KV)

    def write():
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    def attend():
        ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, qsl, seq_lens, dim ** -0.5, True, None, window,
                                        table, 0.0, meta, sinks)
        return out

    return write, attend


def vllm_dense(num_reqs, ctx, heads, groups, dim, reps, q_len=1):
    """vLLM's CPU attention over `ctx` keys per request (its own cache layout), `q_len` causal rows each."""
    return median_ms(vllm_layer(num_reqs, ctx, heads, groups, dim, q_len=q_len)[1], reps)


def hysparse_layers(num_reqs, ctx, reps, q_len=1):
    """A HySparse sparse layer's attention as served, both branches, against a dense layer's.

    Sparse: the window branch's K/V write and attention over the layer's own cache with sinks (the C++ window walk,
    `csrc_triton/window.py`, as served on CPU since 2026-12-07; and vLLM's CPU sliding-window attention, as served
    before, in rows of its own), the global branch (the C++ block-sparse kernel over the oracle's blocks of the shared
    cache, with sinks) and the gate mix (sigmoid(g_sparse) * global + sigmoid(g_swa) * window): as served, in the
    kernels' stores (the window walk stores its gated rows, the block-sparse kernel adds its own); as served before,
    after both kernels, compiled or eager, whichever is faster alone. Dense: the layer's K/V write and vLLM's
    attention over the whole context.
    Per-step work (the oracle's selection, our plan, vLLM's scheduler metadata) is outside both. `q_len` rows per
    request (a prefill chunk: one request). Timed cold (`median_ms(cold=True)`): repeated warm, the dense layer's
    one cache stays in the 32 MiB L3 at 512 tokens while the sparse layer's two caches evict each other, which no
    engine step sees.
    """
    s = HYSPARSE
    kv, table, qsl, seq_lens = paged_batch(num_reqs, ctx, s["groups"], s["dim"], q_len=q_len)
    n = num_reqs * q_len
    q = torch.randn(n, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, n, q.device)
    args = (q, kv[..., :s["dim"]], kv[..., s["dim"]:], table, qsl, seq_lens)
    _, ids = oracle_attention_batched(*args, scale=0.125, sparse_block_size=s["block"], topk=s["topk"], plan=plan)
    sinks = torch.zeros(s["heads"])
    gates = torch.randn(n, 2 * s["heads"] * s["dim"])  # elementwise gates of both branches (`small`)
    run = bind_block_sparse(q, args[1], args[2], scale=0.125, sparse_block_size=s["block"], sinks=sinks)
    assert run is not None, "the C++ block-sparse kernel is not built"
    out = torch.empty(2, n, s["heads"], s["dim"])  # both branches' rows in one buffer, as the fused op writes them
    wkv, wtable, _, _ = paged_batch(num_reqs, ctx, s["groups"], s["dim"], seed=2, q_len=q_len)
    writer = bind_write_kv(wkv[..., :s["dim"]], wkv[..., s["dim"]:])
    key, value = torch.randn(n, s["groups"], s["dim"]), torch.randn(n, s["groups"], s["dim"])
    slots = wtable[plan.row_req, plan.row_pos // PAGE].long() * PAGE + plan.row_pos % PAGE
    window = bind_window(q, wkv[..., :s["dim"]], wkv[..., s["dim"]:], scale=0.125, sinks=sinks, window=s["window"])
    assert window is not None, "the C++ window walk is not built"
    vllm_write, vllm_window = vllm_layer(num_reqs, ctx, s["heads"], s["groups"], s["dim"], q_len=q_len,
                                         window=s["window"], seed=2, out=out[1])
    dense_write, dense = vllm_layer(num_reqs, ctx, s["heads"], s["groups"], s["dim"], q_len=q_len, seed=3)

    def window_branch():
        writer(key, value, slots)
        window(q, wtable, plan, out[1])

    mixed = torch.empty(n, s["heads"], s["dim"])  # the layer's one output, both branches gated into it
    g_sparse, g_swa = gates.view(n, 2, s["heads"], s["dim"]).unbind(1)

    def gated_layer():
        writer(key, value, slots)
        window(q, wtable, plan, mixed, gate=g_swa)
        run(q, table, plan, mixed, ids, g_sparse, True)
        return mixed

    def vllm_window_branch():
        vllm_write()
        vllm_window()

    def gate_mix():
        o_sparse, o_swa = out.view(2, n, -1).unbind(0)
        g_sparse, g_swa = gates.chunk(2, dim=-1)
        return g_sparse.sigmoid() * o_sparse + g_swa.sigmoid() * o_swa

    # Served before 2026-12-07_1300, the mix was fused into the model's forward, which vLLM compiles on the CPU: one
    # loop, none of the eager ops' three [n, H * D] temporaries (2,048 rows at 8k: 3.2-3.3 ms eager against 2.0-2.1
    # compiled), nor the per-call checks of a compiled function called alone (8 decode rows: 0.16-0.29 ms compiled
    # against 0.09-0.15 eager; attention_micro_2026-12-07_1012 and _1034). Its row takes the faster of the two alone
    # as the stand-in for that loop.
    compiled_mix = torch.compile(gate_mix, dynamic=False)
    compiled_mix()
    mixes = {"compiled": compiled_mix, "eager": gate_mix}
    mix_ms = {name: median_ms(fn, reps, cold=True) for name, fn in mixes.items()}
    fastest = min(mix_ms, key=mix_ms.get)
    mix = mixes[fastest]

    def sparse_layer(branch=window_branch):
        branch()
        run(q, table, plan, out[0], ids)
        return mix()

    def dense_layer():
        dense_write()
        return dense()

    label = "sparse layer" if q_len == 1 else f"prefill {q_len} rows, sparse layer"

    def timed(fn):
        return median_ms(fn, reps, cold=True)

    # the same layer either way (up to the rounding of the sigmoid and of the gated terms' order)
    torch.testing.assert_close(gated_layer().view(n, -1), sparse_layer(), atol=1e-5, rtol=1e-5)

    return {f"{label}: HySparse (both branches, sinks, window write, gate mix in the kernels' stores)":
                timed(gated_layer),
            f"{label}: HySparse, gate mix after both kernels ({fastest}; served before 2026-12-07_1300)":
                timed(sparse_layer),
            f"{label}: HySparse, window on vLLM's kernel, mix after (served before 2026-12-07)":
                timed(lambda: sparse_layer(vllm_window_branch)),
            f"{label}: its global branch alone (C++)": timed(lambda: run(q, table, plan, out[0], ids)),
            f"{label}: its window branch alone (K/V write + C++ window walk)": timed(window_branch),
            f"{label}: its window branch on vLLM's CPU sliding window (before)": timed(vllm_window_branch),
            **{f"{label}: its gate mix alone, {name}": ms for name, ms in mix_ms.items()},
            f"{label}: dense layer (K/V write + vLLM CPU attention, G=4)": timed(dense_layer)}


def patched(module, name: str, value, fn):
    """`fn` run with `module.<name>` set to `value`, restored after."""
    def run():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, saved)
    return run


def without(module, finder: str, fn):
    """`fn` run with `module.<finder>` (a kernel finder) answering None: the role's previous CPU path."""
    return patched(module, finder, lambda *a: None, fn)


def previous_oracle(fn):
    """`fn` run on the oracle's previous CPU path (no tiled kernel: the one-pass C++ decode kernel or PyTorch
    GEMMs, selection in PyTorch)."""
    return without(oracle_batched, "tiled_kernel", fn)


def previous_token_oracle(fn):
    """`fn` run on the token oracle's previous CPU path: decode rows through the one-pass C++ kernel's logits,
    prefill rows through PyTorch GEMMs, the selection in PyTorch (no `token_oracle/cpu_select.cpp`). Results up to
    2026-12-06_0203 took decode rows through the tiled kernel's logits instead."""
    return without(token_oracle_batched, "cpu_kernels", fn)


def two_pass_prefill(fn):
    """`fn` with the token oracle's prefill rows through the tiled kernel's second pass (R) at every length (as
    served past `ONE_PASS_MAX_KEYS` keys)."""
    return patched(token_oracle_batched, "ONE_PASS_MAX_KEYS", 0, fn)


def one_pass_prefill(fn):
    """`fn` with the token oracle's prefill rows through the tiled kernel's logits (one pass, every head's logits
    written and read back by the selection): the prefill path until 2026-12-06, and since 2026-12-07 that of runs
    of at most `ONE_PASS_MAX_KEYS` keys."""
    return patched(token_oracle_batched, "PREFILL_TWO_PASS", False, fn)


def hysparse_prefill(ctx, rows, reps):
    """One prefill chunk: the last `rows` rows of one request of `ctx` positions."""
    s = HYSPARSE
    rows = min(rows, ctx)
    kv, table, _, seq_lens = paged_batch(1, ctx, s["groups"], s["dim"])
    qsl = torch.tensor([0, rows], dtype=torch.int32)
    k_cache, v_cache = kv[..., :s["dim"]], kv[..., s["dim"]:]
    q = torch.randn(rows, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, rows, q.device)

    def oracle():
        return oracle_attention_batched(q, k_cache, v_cache, table, qsl, seq_lens, scale=0.125,
                                        sparse_block_size=s["block"], topk=s["topk"], plan=plan)

    return {
        f"prefill {rows} rows: oracle (tiled C++)": median_ms(oracle, reps),
        f"prefill {rows} rows: oracle (previous path)": median_ms(previous_oracle(oracle), reps),
        f"prefill {rows} rows: dense (vLLM CPU, G=4)": vllm_dense(1, ctx, s["heads"], s["groups"], s["dim"], reps,
                                                                 q_len=rows),
    }


def hysparse2_prefill(ctx, rows, reps):
    """One prefill chunk of the HySparse2 token oracle: the last `rows` rows of one request of `ctx` positions."""
    s = HYSPARSE2
    rows = min(rows, ctx)
    kv, table, _, seq_lens = paged_batch(1, ctx, s["groups"], s["dim"], seed=1)
    qsl = torch.tensor([0, rows], dtype=torch.int32)
    q = torch.randn(rows, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, rows, q.device)

    def token_oracle():
        return token_oracle_attention_batched(q, kv[..., :s["dim"]], kv[..., s["dim"]:], table, qsl, seq_lens,
                                              scale=0.125, topk_tokens=s["topk"], recent_window=s["window"],
                                              plan=plan)

    def attention_alone():
        """The tiled kernel on the same rows without logits: the attention the C++ path cannot go below."""
        n, heads = q.shape[:2]
        pos = torch.arange(ctx - rows, ctx)
        tiled.oracle_tiled(q, kv, table, torch.zeros(n, dtype=torch.long), pos, ctx, 0, 0.125, torch.empty_like(q),
                           torch.empty(n, s["groups"], 0, dtype=torch.int32), torch.empty(0), torch.empty(0),
                           torch.empty(0))

    tiled = cpu_ext.load("oracle_tiled")
    return {
        f"prefill {rows} rows: token_oracle (C++, two passes)": median_ms(two_pass_prefill(token_oracle), reps),
        f"prefill {rows} rows: token_oracle (C++, one pass with logits)": median_ms(one_pass_prefill(token_oracle),
                                                                                    reps),
        f"prefill {rows} rows: token_oracle attention alone (tiled kernel, no logits)": median_ms(attention_alone,
                                                                                                  reps),
        f"prefill {rows} rows: token_oracle (previous path)": median_ms(previous_token_oracle(token_oracle), reps),
        f"prefill {rows} rows: dense (vLLM CPU, G=1)": vllm_dense(1, ctx, s["heads"], s["groups"], s["dim"], reps,
                                                                 q_len=rows),
    }


def hysparse_roles(num_reqs, ctx, reps):
    s = HYSPARSE
    kv, table, qsl, seq_lens = paged_batch(num_reqs, ctx, s["groups"], s["dim"])
    k_cache, v_cache = kv[..., :s["dim"]], kv[..., s["dim"]:]
    q = torch.randn(num_reqs, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, num_reqs, q.device)
    args = (q, k_cache, v_cache, table, qsl, seq_lens)
    _, ids = oracle_attention_batched(*args, scale=0.125, sparse_block_size=s["block"], topk=s["topk"], plan=plan)
    sinks = torch.zeros(s["heads"])

    def oracle():
        return oracle_attention_batched(*args, scale=0.125, sparse_block_size=s["block"], topk=s["topk"], plan=plan)

    stats = PagesPerQueryStats()  # no METRICS_DIR here: nothing is published
    stats.enabled = True
    return {
        "oracle (tiled C++)": median_ms(oracle, reps),
        "oracle (previous path)": median_ms(previous_oracle(oracle), reps),
        "block_sparse": median_ms(lambda: block_sparse_attention_batched(
            *args, ids, scale=0.125, sparse_block_size=s["block"], sinks=sinks, plan=plan), reps),
        "metrics (pages per query, as served)": median_ms(lambda: stats.add(ids, plan.row_pos, s["block"], PAGE), reps),
        "dense (vLLM CPU, G=4)": vllm_dense(num_reqs, ctx, s["heads"], s["groups"], s["dim"], reps),
    }


def hysparse2_roles(num_reqs, ctx, reps):
    s = HYSPARSE2
    kv, table, qsl, seq_lens = paged_batch(num_reqs, ctx, s["groups"], s["dim"], seed=1)
    k_cache, v_cache = kv[..., :s["dim"]], kv[..., s["dim"]:]
    q = torch.randn(num_reqs, s["heads"], s["dim"])
    plan = make_plan(qsl, seq_lens, num_reqs, q.device)
    args = (q, k_cache, v_cache, table, qsl, seq_lens)
    kwargs = dict(scale=0.125, topk_tokens=s["topk"], recent_window=s["window"], plan=plan)
    _, ids = token_oracle_attention_batched(*args, **kwargs)
    sinks = torch.zeros(s["heads"])

    def token_oracle():
        return token_oracle_attention_batched(*args, **kwargs)

    return {
        "token_oracle (C++)": median_ms(token_oracle, reps),
        "token_oracle (previous path)": median_ms(previous_token_oracle(token_oracle), reps),
        "token_sparse": median_ms(lambda: token_sparse_attention_batched(
            *args, ids, scale=0.125, sinks=sinks, plan=plan), reps),
        "dense (vLLM CPU, G=1)": vllm_dense(num_reqs, ctx, s["heads"], s["groups"], s["dim"], reps),
    }


def ratio_to_dense(roles: dict, role: str) -> float:
    """`role`'s time over its baseline's in the same group: the role whose name, after the same `...: ` prefix,
    starts with `dense`."""
    prefix = role.split(": ")[0] + ": " if ": " in role else ""
    return roles[role] / next(v for k, v in roles.items() if k.startswith(prefix + "dense"))


# The ratios issue 20 sets goals for: (panel, group, a sparse layer's row or not, how the role's name ends after
# its prefix starts, goal by context or None). The oracles' goal is stated for 8k and 32k, the sparse layer's for
# 512 tokens and 8k.
HEADLINES = (
    ("oracle, decode", "HySparse", False, "oracle (tiled C++)", {8192: 1.1, 32768: 1.1}),
    ("oracle, prefill chunk", "HySparse prefill", False, "oracle (tiled C++)", {8192: 1.1, 32768: 1.1}),
    ("token oracle, decode", "HySparse2", False, "token_oracle (C++)", {8192: 1.1, 32768: 1.1}),
    ("token oracle, prefill chunk", "HySparse2 prefill", False, "token_oracle (C++, two passes)",
     {8192: 1.1, 32768: 1.1}),
    ("sparse layer, decode", "HySparse", True, "HySparse (both branches", {512: 1.1, 8192: 0.15}),
    ("sparse layer, prefill chunk", "HySparse prefill", True, "HySparse (both branches", {512: 1.1, 8192: 0.15}),
)


def plot(result: dict, path: Path) -> None:
    """One panel per headline ratio (`HEADLINES`): a bar per context, its goal as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(11, 6.4))
    for ax, (title, group, layer, start, goals) in zip(axes.flat, HEADLINES):
        bars = []
        for ctx, arches in result["contexts"].items():
            roles = arches.get(group, {})
            role = next((k for k in roles if ("sparse layer" in k) == layer and k.split(": ")[-1].startswith(start)),
                        None)
            if role is not None:
                bars.append((int(ctx), ratio_to_dense(roles, role)))
        xs = range(len(bars))
        ax.bar(xs, [r for _, r in bars], color="tab:blue")
        for x, (ctx, r) in zip(xs, bars):
            ax.text(x, r, f"{r:.2f}x", ha="center", va="bottom", fontsize=8)
            if ctx in goals:
                ax.hlines(goals[ctx], x - 0.4, x + 0.4, color="black", lw=1.5)
        ax.set_xticks(list(xs), [f"{ctx // 1024}k" if ctx >= 1024 else str(ctx) for ctx, _ in bars])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("time / dense layer's", fontsize=8)
    fig.suptitle(f"{result['command']} ({result['machine']}); black ticks: goals", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(result) -> str:
    shared = " on one shared prompt" if result.get("shared_prefix") else ""
    lines = [f"# Attention microbenchmark (CPU, float32, one decode step of {result['num_reqs']} requests{shared}, "
             "one prefill chunk)", "",
             f"`{result['command']}` on {result['machine']}, torch {result['torch']}, load average before the run "
             f"{result.get('load', '?')}; median of "
             f"{result['reps']} runs, ms per layer call.", "",
             "| context | role | ms | vs dense |", "| ---: | --- | ---: | ---: |"]
    for ctx, arches in result["contexts"].items():
        for arch, roles in arches.items():
            for role, ms in roles.items():
                lines.append(f"| {ctx} | {arch} {role} | {ms:.2f} | {ratio_to_dense(roles, role):.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--num-reqs", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prefill-rows", type=int, default=2048, help="rows of the prefill chunk (0: none)")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="the decode requests read one prompt's pages (vLLM's prefix cache); prefill unchanged")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="write the .md and .png of an earlier run's JSON beside it, and measure nothing")
    args = parser.parse_args(argv)
    if args.report_from:
        result = json.loads(args.report_from.read_text())
        args.report_from.with_suffix(".md").write_text(markdown(result))
        plot(result, args.report_from.with_suffix(".png"))
        return 0
    torch.set_grad_enabled(False)
    global SHARED_PREFIX
    SHARED_PREFIX = args.shared_prefix
    result = {"command": "python benchmarks/attention_micro.py " + " ".join(argv or sys.argv[1:]),
              "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {machine_info()['cpu']}",
              "torch": torch.__version__,
              "num_reqs": args.num_reqs, "reps": args.reps, "shared_prefix": args.shared_prefix, "contexts": {}}
    for ctx in args.contexts:
        result["contexts"][ctx] = {"HySparse": hysparse_roles(args.num_reqs, ctx, args.reps),
                                   "HySparse2": hysparse2_roles(args.num_reqs, ctx, args.reps)}
        result["contexts"][ctx]["HySparse"].update(hysparse_layers(args.num_reqs, ctx, args.reps))
        if args.prefill_rows:
            result["contexts"][ctx]["HySparse prefill"] = hysparse_prefill(ctx, args.prefill_rows, args.reps)
            result["contexts"][ctx]["HySparse prefill"].update(
                hysparse_layers(1, ctx, args.reps, q_len=min(args.prefill_rows, ctx)))
            result["contexts"][ctx]["HySparse2 prefill"] = hysparse2_prefill(ctx, args.prefill_rows, args.reps)
    text = markdown(result)
    print(text)
    args.results.mkdir(parents=True, exist_ok=True)
    tag = "_shared" if args.shared_prefix else ""
    stem = args.results / f"attention_micro_{datetime.datetime.now():%Y-%m-%d_%H%M}{tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(text)
    plot(result, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
