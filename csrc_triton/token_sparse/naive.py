# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch token-sparse paged attention: the readable twin of `kernel.py`, and its CPU fallback.

Per request, the selected key positions are gathered straight from the pages
and one sink softmax runs over them in float32.
"""

import torch

from csrc_triton.block_sparse.naive import gather_paged, sink_attention

# Query rows gathered at once; bounds memory at rows * G * S * D floats.
QUERY_CHUNK = 16


def token_sparse_attention_naive(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, token_indices, *,
                                 scale, sinks=None, out=None):
    """Same contract as `csrc_triton.token_sparse.token_sparse_attention`.

    Keys of row i: positions `token_indices[i, g]` (-1 skipped) at or before the row's position.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    per_group = num_heads // num_kv_heads
    head_dim_v = v_cache.shape[3]  # values may be narrower or wider than q/k (SPEC §2.6)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    out.zero_()
    group_sinks = None if sinks is None else sinks.float().view(num_kv_heads, per_group)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        bos, eos = starts[r], min(starts[r + 1], num_tokens)
        for s in range(bos, eos, QUERY_CHUNK):
            e = min(s + QUERY_CHUNK, eos)
            rows = torch.arange(s, e, device=q.device)
            query_pos = seq_len - (starts[r + 1] - bos) + (rows - bos)  # [n]
            positions = token_indices[s:e].long()  # [n, G, S]
            valid = (positions >= 0) & (positions <= query_pos[:, None, None])
            positions = torch.where(valid, positions, 0)
            k = gather_paged(k_cache, block_table[r], positions)
            v = gather_paged(v_cache, block_table[r], positions)
            qg = q[s:e].float().view(e - s, num_kv_heads, per_group, head_dim)
            o = sink_attention(qg, k, v, valid, scale, group_sinks)
            out[s:e] = o.reshape(e - s, num_heads, head_dim_v).to(out.dtype)
    return out
