# SPDX-License-Identifier: Apache-2.0
"""Token oracle attention as batched PyTorch: the CPU serving path (same contract as `token_oracle_attention`).

The exact probabilities of the output also rank the tokens, so every key is
scored once. Decode rows of all requests run together. The top-k is a
`torch.topk` threshold plus an ordered tie fill, which keeps SPEC's tie rule
(smaller position first) without sorting every row.

Where the C++ kernels are built (float32, vLLM's interleaved pages, D_k == D_v),
every row runs through the tiled oracle kernel and the selection runs in C++
(`cpu_select.cpp`): the same threshold and tie fill, linear in the context, with
no PyTorch top-k. Decode rows get their logits and log-sum-exps from the kernel
(shared prefixes are walked once, in parts); prefill rows get the reduced
probabilities R from the kernel's second pass over each tile's keys, twelve
times less to write and read back than every head's logits.
"""

import torch

from csrc_triton import cpu_ext
from csrc_triton.paged_args import check_paged_batch, kv_scaled
from csrc_triton.paged_batch import (
    ELEMENT_BUDGET,
    BatchPlan,
    chunks,
    cpu_kernel_pages,
    oracle_attention_rows,
    plan_or_make,
)

REDUCES = ("max", "sum")


def select_tokens(r: torch.Tensor, pos: torch.Tensor, topk_tokens: int, recent_window: int) -> torch.Tensor:
    """`S_t = sorted(W_t ∪ top-k of r outside W_t)` for every row (SPEC §3.3).

    Args:
        r: `[N, G, S]` float32 reduced probabilities over keys `[0, S)`, finite.
        pos: `[N]` int64 query positions (< S).
    Returns:
        `[N, G, topk_tokens + recent_window]` int64 positions, ascending, -1 padded.
    """
    n, g, s = r.shape
    width = topk_tokens + recent_window
    if s - recent_window <= topk_tokens:
        return all_visible(pos, g, width)
    j = torch.arange(s, device=r.device)
    window_start = pos - recent_window + 1
    chosen = ((j[None, :] >= window_start[:, None]) & (j[None, :] <= pos[:, None]))[:, None, :].repeat(1, g, 1)
    if topk_tokens > 0 and s > 0:
        candidate = (j[None, :] < window_start[:, None])[:, None, :]  # j <= t and outside W_t
        keyed = r.masked_fill(~candidate, float("-inf"))
        k = min(topk_tokens, s)
        kth = keyed.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # k-th largest (-inf: < k)
        above = keyed > kth
        tie = (keyed == kth) & candidate
        missing = k - above.sum(dim=-1, keepdim=True)
        chosen |= above | (tie & (tie.cumsum(dim=-1) <= missing))  # ties fill in position order
    # compact the chosen positions, in order, into `width` slots (slot `width` collects the rest)
    slot = torch.where(chosen, chosen.cumsum(dim=-1) - 1, width)
    ids = torch.full((n, g, width + 1), -1, dtype=torch.long, device=r.device)
    ids.scatter_(-1, slot, j.expand(n, g, s))
    ids[..., width] = -1
    return ids[..., :width]


def all_visible(pos: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """`select_tokens` where no row has more than `topk_tokens` keys outside its window (a context of at most
    `width` keys, a host shape): every row selects `[0, pos]`. `[N, G, width]` int64, -1 padded."""
    j = torch.arange(width, device=pos.device)
    return torch.where(j[None, :] <= pos[:, None], j[None, :], -1)[:, None, :].expand(-1, groups, -1)


def select_from_logits(z, lse, limit, topk_tokens: int, recent_window: int, reduce: str):
    """The token selection S_t from a row's logits: exact probabilities, reduced over the group's heads.

    Args:
        z: `[b, G, r, P, S]` logits, -inf past each row's position; lse: `[b, G, r, P, 1]`;
        limit: `[b, r]` each row's position.
    Returns:
        positions `[b, r, G, topk_tokens + recent_window]`.
    """
    b, g, r = z.shape[:3]
    if z.shape[-1] - recent_window <= topk_tokens:  # every visible key is selected: no scores needed
        return all_visible(limit.reshape(-1), g, topk_tokens + recent_window).view(b, r, g, -1)
    probs = torch.exp(z - lse)
    reduced = probs.amax(dim=3) if reduce == "max" else probs.sum(dim=3)  # [b, G, r, S]
    s = reduced.shape[-1]
    ids = select_tokens(reduced.transpose(1, 2).reshape(b * r, g, s), limit.reshape(-1), topk_tokens, recent_window)
    return ids.view(b, r, g, -1)


@kv_scaled
def token_oracle_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale,
                                   topk_tokens, recent_window, score_head_reduce="max", out=None,
                                   plan: BatchPlan | None = None):
    """`token_oracle_attention` in batched PyTorch; `plan` (from `make_plan`) spares the host read of the batch.

    Returns out `[T, H, Dv]` and positions `[T, G, topk_tokens + recent_window]` int32; rows past the last
    request get 0 and -1.
    """
    if score_head_reduce not in REDUCES:
        raise ValueError(f"score_head_reduce: must be 'max' or 'sum' (got {score_head_reduce!r})")
    out, _ = check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)
    plan = plan_or_make(plan, query_start_loc, seq_lens, q.shape[0])
    width = topk_tokens + recent_window
    indices = torch.full((q.shape[0], k_cache.shape[1], width), -1, dtype=torch.int32, device=q.device)
    out[plan.num_tokens:].zero_()

    run = bind_token_oracle(q, k_cache, v_cache, scale=scale, topk_tokens=topk_tokens, recent_window=recent_window,
                            score_head_reduce=score_head_reduce)
    if run is not None:
        run(q, block_table, plan, out, indices)
        return out, indices

    def select(z, lse, limit):
        return select_from_logits(z, lse, limit, topk_tokens, recent_window, score_head_reduce)

    oracle_attention_rows(q, k_cache, v_cache, block_table, plan, out, indices, scale=scale, select=select)
    return out, indices


def bind_token_oracle(q, k_cache, v_cache, *, scale, topk_tokens, recent_window, score_head_reduce="max"):
    """The C++ kernels of `token_oracle_attention_batched` bound to one layer's pages and selection (see
    `paged_batch.bind_sparse`), or None where they do not apply. Returns `run(q [n, H, D], block_table, plan,
    out [n, H, Dv], ids [n, G, topk_tokens + recent_window] int32)`, writing out and every row of ids in place.
    `score_head_reduce` is one of `REDUCES` (checked by the config and by `token_oracle_attention_batched`).
    """
    kernels = cpu_kernels(q, k_cache, v_cache)
    if kernels is None:
        return None

    def run(q, block_table, plan, out, ids):
        run_cpu_kernels(q, *kernels, block_table, plan, out, ids, scale=scale, topk_tokens=topk_tokens,
                        recent_window=recent_window, reduce=score_head_reduce)

    return run


# Logits (decode) or R (prefill) the C++ path holds at once, in floats: bounds the rows of a chunk (128 MB; 341
# decode rows of 12 heads at 8k, 4,096 prefill rows of one group).
LOGIT_BUDGET = 2 * ELEMENT_BUDGET
# The logits scratch, kept between calls: a fresh 128 MB buffer pays a page fault per 4 KB on its first write, which
# on a 2,048-row prefill chunk at 8k cost more than the selection itself.
_SCRATCH: dict[str, torch.Tensor] = {}


# Prefill rows through the kernel's second pass (R), not its logits: 2,048 rows at 32k, 1,465 against 2,048 ms; at
# 8k the same within noise (README.md, "On the CPU"). False only for the benchmark's comparison.
PREFILL_TWO_PASS = True
# ... except a run of at most this many keys, whose rows' logits are few: one pass with logits / two passes, caches
# evicted, 0.96 for 512 rows at 512 keys, 0.89 for 1,024 rows at 2k, 0.94 and 1.00 for 2,048 rows at 4k and 8k
# (benchmarks/results/experiments/shared_decode_2026-12-07.md).
ONE_PASS_MAX_KEYS = 4096


def _scratch(numel: int) -> torch.Tensor:
    """A float32 buffer of at least `numel` elements, reused by every call (one engine thread runs the layers)."""
    buf = _SCRATCH.get("logits")
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH["logits"] = torch.empty(numel)
    return buf[:numel]


def cpu_kernels(q, k_cache, v_cache):
    """(pages, tiled oracle, token select) where the C++ path applies, else None (then PyTorch runs)."""
    base = cpu_kernel_pages(k_cache, v_cache)
    if base is None:
        return None
    tiled, select = cpu_ext.load("oracle_tiled"), cpu_ext.load("token_select")
    if tiled is None or select is None or q.shape[-1] not in tiled.SUPPORTED_DIMS:
        return None
    return base, tiled, select


def run_cpu_kernels(q, pages, tiled, select, block_table, plan: BatchPlan, out, indices, *, scale, topk_tokens,
                    recent_window, reduce) -> None:
    """Every row of a step through the C++ kernels: decode rows together, each prefill run in chunks of rows.

    A chunk's rows are scored against `num_keys` keys (a host bound from the plan: the longest decode, or the
    last row of the run's chunk). Decode rows: the tiled oracle writes their output, logits `[n, H, num_keys]` and
    lse `[n, H]` (one block spanning every key, no block top-k), and `token_select` turns those into S_t; so do the
    prefill rows of a run of at most `ONE_PASS_MAX_KEYS` keys. Longer prefill runs: its two-pass form writes the
    output and R `[n, G, num_keys]`, and `token_select_probs` selects from R.
    """
    heads, groups = q.shape[1], indices.shape[1]
    for rows, reqs, pos, num_keys, two_pass in _row_chunks(plan, heads, groups, q.device):
        n = rows.shape[0]
        qr, pr = q[rows].float().contiguous(), pos.contiguous()
        o = torch.empty_like(qr)
        ids = torch.empty(n, groups, indices.shape[2], dtype=torch.int32)
        if two_pass:
            probs = _scratch(n * groups * num_keys).view(n, groups, num_keys)
            tiled.oracle_tiled_reduced(qr, pages, block_table, reqs.contiguous(), pr, scale, reduce == "sum", o,
                                       probs)
            select.token_select_probs(probs, pr, topk_tokens, recent_window, ids)
        else:
            buf = _scratch(n * heads * (num_keys + 1))
            logits = buf[:n * heads * num_keys].view(n, heads, num_keys)
            lse = buf[n * heads * num_keys:].view(n, heads)
            tiled.oracle_tiled(qr, pages, block_table, reqs.contiguous(), pr, num_keys, 0, scale, o,
                               torch.empty(n, groups, 0, dtype=torch.int32), torch.empty(0), logits, lse)
            select.token_select(logits, lse, pr, groups, topk_tokens, recent_window, reduce == "sum", ids)
        out[rows] = o.to(out.dtype)
        indices[rows] = ids


def _row_chunks(plan: BatchPlan, heads: int, groups: int, device):
    """(rows, their requests, their positions, keys to score, two passes?) for chunks whose scratch fits
    `LOGIT_BUDGET`: the decode rows (every head's logits, against the longest decode), then each prefill run's rows
    (R of every group in two passes past `ONE_PASS_MAX_KEYS` keys, against the chunk's last row)."""
    num_keys = max(plan.max_decode_len, 1)
    for s, e in chunks(plan.num_decodes, LOGIT_BUDGET // (heads * num_keys)):
        yield plan.decode_rows[s:e], plan.decode_reqs[s:e], plan.decode_lens[s:e] - 1, num_keys, False
    for run in plan.prefills:
        two_pass = PREFILL_TWO_PASS and run.seq_len > ONE_PASS_MAX_KEYS
        per_row = groups if two_pass else heads
        for s, e in chunks(run.end - run.start, LOGIT_BUDGET // (per_row * run.seq_len)):
            a, b = run.start + s, run.start + e
            yield (torch.arange(a, b, device=device), torch.full((e - s,), run.req, device=device),
                   plan.row_pos[a:b], run.first_pos + e, two_pass)
