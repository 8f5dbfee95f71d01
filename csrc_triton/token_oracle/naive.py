# SPDX-License-Identifier: Apache-2.0
"""Token oracle attention in plain PyTorch: a per-request loop over the paged cache, written for obviousness.

Same signature and results as `csrc_triton.token_oracle.token_oracle_attention`;
it is the tests' reference for the kernel and the CPU fallback. Math in float32.
"""

import torch

from csrc_triton.oracle.naive import gather_pages

# query rows scored at a time, so a request never holds more than rows x heads x seq_len logits
QUERY_CHUNK = 64
REDUCES = ("max", "sum")


def select_tokens(r, pos, topk_tokens, recent_window):
    """`S_t = sorted(W_t ∪ top-k of r outside W_t)` for every row.

    Args:
        r: `[N, G, S]` float32 reduced probabilities over keys `[0, S)`.
        pos: `[N]` query positions (< S).
    Returns:
        `[N, G, topk_tokens + recent_window]` int64 positions, ascending, -1 padded.
    """
    num_keys = r.shape[-1]
    width = topk_tokens + recent_window
    j = torch.arange(num_keys, device=r.device)
    window_start = pos - recent_window + 1  # [N]
    in_window = (j[None, :] >= window_start[:, None]) & (j[None, :] <= pos[:, None])  # [N, S]
    candidate = (j[None, :] < window_start[:, None])[:, None, :].expand_as(r)  # j <= t and outside W_t
    # a stable descending sort keeps equal scores in position order: ties go to the smaller position
    keyed = r.masked_fill(~candidate, float("-inf"))
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[..., :topk_tokens]
    picked = torch.gather(candidate, -1, order)  # rows with fewer candidates than topk_tokens
    chosen = torch.zeros(r.shape, dtype=torch.bool, device=r.device).scatter_(-1, order, picked) | in_window[:, None, :]
    # chosen positions in ascending order, the rest (num_keys) sorted behind them and turned into -1
    ids = torch.where(chosen, j, num_keys).sort(dim=-1).values[..., :width]
    ids = ids.masked_fill(ids == num_keys, -1)
    return torch.nn.functional.pad(ids, (0, width - ids.shape[-1]), value=-1)


def attend_rows(q, k, v, pos, scale, topk_tokens, recent_window, reduce):
    """Queries `[N, H, D]` at positions `pos` `[N]` over keys `[S, G, D]` and values `[S, G, Dv]` (float32).

    Returns out `[N, H, Dv]` float32 and the selected positions `[N, G, topk_tokens + recent_window]`.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [S, H, D], head h reads group h // group
    v = v.repeat_interleave(group, dim=1)
    z = torch.einsum("nhd,shd->nhs", q, k) * scale  # [N, H, S]
    z = z.masked_fill(torch.arange(k.shape[0], device=q.device)[None, None, :] > pos[:, None, None], float("-inf"))
    p = torch.softmax(z, dim=-1)  # exact probabilities P_h[t, j], no sink
    out = torch.einsum("nhs,shd->nhd", p, v)
    grouped = p.view(p.shape[0], num_kv_heads, group, p.shape[-1])
    r = grouped.amax(dim=2) if reduce == "max" else grouped.sum(dim=2)  # [N, G, S]
    return out, select_tokens(r, pos, topk_tokens, recent_window)


def token_oracle_attention_naive(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, topk_tokens,
                                 recent_window, score_head_reduce="max", out=None):
    """Reference of `token_oracle_attention` (same arguments and results, see its docstring)."""
    if score_head_reduce not in REDUCES:
        raise ValueError(f"score_head_reduce: must be 'max' or 'sum' (got {score_head_reduce!r})")
    assert topk_tokens >= 0 and recent_window >= 0 and topk_tokens + recent_window >= 1, \
        f"need topk_tokens, recent_window >= 0 with a positive sum (got {topk_tokens}, {recent_window})"
    num_tokens = q.shape[0]
    num_kv_heads = k_cache.shape[1]
    width = topk_tokens + recent_window
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if out is None:  # values, so outputs, are v_cache's width (SPEC §2.6)
        out = torch.empty(*q.shape[:2], v_cache.shape[3], dtype=q.dtype, device=q.device)
    out.zero_()
    indices = torch.full((num_tokens, num_kv_heads, width), -1, dtype=torch.int32, device=q.device)
    for r, seq_len in enumerate(lens):
        start, end = starts[r], starts[r + 1]
        if end <= start:
            continue
        k = gather_pages(k_cache, block_table[r], seq_len)
        v = gather_pages(v_cache, block_table[r], seq_len)
        for s in range(start, end, QUERY_CHUNK):
            e = min(s + QUERY_CHUNK, end)
            # request rows are the last (end - start) positions of the sequence
            pos = torch.arange(s, e, device=q.device) - end + seq_len
            n_keys = seq_len - (end - e)
            o, ids = attend_rows(q[s:e].float(), k[:n_keys], v[:n_keys], pos, scale, topk_tokens, recent_window,
                                 score_head_reduce)
            out[s:e] = o.to(out.dtype)
            indices[s:e] = ids.to(torch.int32)
    return out, indices
