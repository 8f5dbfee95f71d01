# SPDX-License-Identifier: Apache-2.0
"""Oracle attention in plain PyTorch: a per-request loop over the paged cache, written for obviousness.

Same signature and results as `csrc_triton.oracle.oracle_attention`; it is the
tests' reference for the kernel and the CPU fallback. Math in float32.
"""

import torch

# query rows scored at a time, so a request never holds more than rows x heads x seq_len logits
QUERY_CHUNK = 256


def gather_pages(cache: torch.Tensor, block_table_row: torch.Tensor, num_keys: int) -> torch.Tensor:
    """`[num_pages, G, page_size, D]` cache -> `[num_keys, G, D]` float32 for positions `[0, num_keys)`."""
    page_size = cache.shape[2]
    pages = block_table_row[: -(-num_keys // page_size)].long()
    x = cache[pages].permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])  # [pages * page_size, G, D]
    return x[:num_keys].float()


def top_blocks(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """`[N, G, NB]` scores, `[N, NB]` visibility -> `[N, G, topk]` ids: best first, ties to the smaller id,
    then ascending, -1 padded."""
    num_blocks = scores.shape[-1]
    visible = visible[:, None, :].expand_as(scores)
    keyed = scores.masked_fill(~visible, float("-inf"))
    # a stable descending sort keeps equal scores in id order
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[..., :topk]
    ids = torch.where(torch.gather(visible, -1, order), order, num_blocks)
    ids = torch.sort(ids, dim=-1).values
    ids = ids.masked_fill(ids == num_blocks, -1)
    return torch.nn.functional.pad(ids, (0, topk - ids.shape[-1]), value=-1)


def attend_rows(q, k, v, pos, scale, sparse_block_size, topk):
    """Queries `[N, H, D]` at positions `pos` `[N]` over keys `[S, G, D]` and values `[S, G, Dv]`.

    Returns out `[N, H, Dv]` float32, indices `[N, G, topk]` and scores R `[N, G, NB]`.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [S, H, D], head h reads group h // group
    v = v.repeat_interleave(group, dim=1)
    z = torch.einsum("nhd,shd->nhs", q, k) * scale  # [N, H, S]
    z = z.masked_fill(torch.arange(k.shape[0], device=q.device)[None, None, :] > pos[:, None, None], float("-inf"))
    out = torch.einsum("nhs,shd->nhd", torch.softmax(z, dim=-1), v)
    # Eq. 3: S = exp(u - m) / l = exp(u - lse), u the block max of the visible logits
    lse = torch.logsumexp(z, dim=-1)  # [N, H]
    num_blocks = -(-k.shape[0] // sparse_block_size)
    z = torch.nn.functional.pad(z, (0, num_blocks * sparse_block_size - k.shape[0]), value=float("-inf"))
    u = z.view(*z.shape[:2], num_blocks, sparse_block_size).amax(dim=-1)  # [N, H, NB]
    s = torch.exp(u - lse[..., None])
    r = s.view(s.shape[0], num_kv_heads, group, num_blocks).amax(dim=2)  # [N, G, NB], group-wise max
    visible = torch.arange(num_blocks, device=q.device)[None, :] * sparse_block_size <= pos[:, None]  # [N, NB]
    return out, top_blocks(r, visible, topk), r


def oracle_attention_naive(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, sparse_block_size,
                           topk, out=None, return_block_scores=False):
    """Reference of `oracle_attention` (same arguments and results, see its docstring)."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    num_blocks = -(-max(lens, default=0) // sparse_block_size)
    if out is None:  # values, so outputs, are v_cache's width (SPEC §2.6)
        out = torch.empty(*q.shape[:2], v_cache.shape[3], dtype=q.dtype, device=q.device)
    out.zero_()
    indices = torch.full((num_tokens, num_kv_heads, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.zeros(num_tokens, num_kv_heads, num_blocks, dtype=torch.float32, device=q.device)
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
            o, ids, rs = attend_rows(q[s:e].float(), k[:n_keys], v[:n_keys], pos, scale, sparse_block_size, topk)
            out[s:e] = o.to(out.dtype)
            indices[s:e] = ids.to(torch.int32)
            scores[s:e, :, : rs.shape[-1]] = rs
    if return_block_scores:
        return out, indices, scores
    return out, indices
