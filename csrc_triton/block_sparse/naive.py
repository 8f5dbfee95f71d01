# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch block-sparse paged attention: the readable twin of `kernel.py`, and its CPU fallback.

Per request, the selected blocks are expanded into key positions, the keys are
gathered straight from the pages, and one sink softmax runs over them in float32.
"""

import torch

# Query rows gathered at once; bounds memory at rows * G * K * block_size * (D + Dv) floats.
QUERY_CHUNK = 16


def sink_attention(q, k, v, valid, scale, sinks):
    """Softmax over gathered keys with an optional sink logit in the denominator.

    Args:
        q: `[n, G, P, D]` float32 (P query heads per KV group).
        k: `[n, G, S, D]`, v: `[n, G, S, Dv]` float32 gathered keys and values.
        valid: `[n, G, S]` bool; invalid keys get no weight (their K/V may be NaN).
        sinks: `[G, P]` float32 or None.
    Returns:
        `[n, G, P, Dv]` float32; rows with neither keys nor sink are 0.
    """
    k = torch.where(valid[..., None], k, 0.0)
    v = torch.where(valid[..., None], v, 0.0)
    z = torch.einsum("ngpd,ngsd->ngps", q, k) * scale
    z = z.masked_fill(~valid[:, :, None, :], float("-inf"))
    m = z.amax(dim=-1)  # [n, G, P]
    if sinks is not None:
        m = torch.maximum(m, sinks.expand_as(m))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - m[..., None])
    den = e.sum(dim=-1)
    if sinks is not None:
        den = den + torch.exp(sinks - m)
    p = e / den.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return torch.einsum("ngps,ngsd->ngpd", p, v)


def gather_paged(cache, block_table_row, positions):
    """`cache [num_pages, G, page, D]`, key positions `[n, G, S]` (>= 0) -> `[n, G, S, D]` float32."""
    page_size = cache.shape[2]
    pages = block_table_row.long()[positions // page_size]
    groups = torch.arange(cache.shape[1], device=cache.device)[None, :, None]
    return cache[pages, groups, positions % page_size].float()


def block_sparse_attention_naive(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, block_indices, *,
                                 scale, sparse_block_size, sinks=None, out=None):
    """Same contract as `csrc_triton.block_sparse.block_sparse_attention`.

    Keys of row i: positions `b * sparse_block_size + j` of its selected blocks
    `b = block_indices[i, g]` (-1 skipped) with position <= the row's position.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    per_group = num_heads // num_kv_heads
    head_dim_v = v_cache.shape[3]  # values may be narrower or wider than q/k (SPEC §2.6)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    out.zero_()
    group_sinks = None if sinks is None else sinks.float().view(num_kv_heads, per_group)
    offsets = torch.arange(sparse_block_size, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        bos, eos = starts[r], min(starts[r + 1], num_tokens)
        for s in range(bos, eos, QUERY_CHUNK):
            e = min(s + QUERY_CHUNK, eos)
            rows = torch.arange(s, e, device=q.device)
            query_pos = seq_len - (starts[r + 1] - bos) + (rows - bos)  # [n]
            blocks = block_indices[s:e].long()  # [n, G, K]
            positions = (blocks[..., None] * sparse_block_size + offsets).flatten(2)  # [n, G, K * block]
            valid = (blocks >= 0).repeat_interleave(sparse_block_size, dim=2)
            valid &= (positions <= query_pos[:, None, None]) & (positions < seq_len)
            positions = torch.where(valid, positions, 0)
            k = gather_paged(k_cache, block_table[r], positions)
            v = gather_paged(v_cache, block_table[r], positions)
            qg = q[s:e].float().view(e - s, num_kv_heads, per_group, head_dim)
            o = sink_attention(qg, k, v, valid, scale, group_sinks)
            out[s:e] = o.reshape(e - s, num_heads, head_dim_v).to(out.dtype)
    return out
