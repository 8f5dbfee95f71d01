# SPDX-License-Identifier: Apache-2.0
"""Oracle attention as batched PyTorch: the CPU serving path (same contract as `oracle_attention`).

One set of logits gives both the exact output and the block maxima of Eq. 3,
so every key is scored once. Decode rows of all requests run together.
"""

import torch

from csrc_triton.oracle.naive import top_blocks
from csrc_triton.paged_args import check_paged_batch, kv_scaled
from csrc_triton.paged_batch import BatchPlan, oracle_attention_rows, plan_or_make


def select_blocks(z, lse, limit, sparse_block_size: int, topk: int):
    """The oracle's top-k blocks from a row's logits (SPEC §3.1, Eq. 3).

    Args:
        z: `[b, G, r, P, S]` logits, -inf past each row's position; lse: `[b, G, r, P, 1]`;
        limit: `[b, r]` each row's position.
    Returns:
        block ids `[b, r, G, topk]` (ascending, -1 padded).
    """
    b, g, r = z.shape[:3]
    s = z.shape[-1]
    num_blocks, full = -(-s // sparse_block_size), s // sparse_block_size
    u = z[..., :full * sparse_block_size].view(*z.shape[:-1], full, sparse_block_size).amax(dim=-1)
    if full < num_blocks:  # the partial last block, without padding a copy of z
        u = torch.cat([u, z[..., full * sparse_block_size:].amax(dim=-1, keepdim=True)], dim=-1)
    scores = torch.exp(u - lse).amax(dim=3)  # [b, G, r, NB]: S = exp(u - lse), max over the group's heads
    starts = torch.arange(num_blocks, device=z.device) * sparse_block_size
    visible = starts[None, None, :] <= limit[:, :, None]  # [b, r, NB]
    ids = top_blocks(scores.transpose(1, 2).reshape(b * r, g, num_blocks), visible.reshape(b * r, num_blocks), topk)
    return ids.view(b, r, g, topk)


@kv_scaled
def oracle_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale,
                             sparse_block_size, topk, out=None, plan: BatchPlan | None = None):
    """`oracle_attention` in batched PyTorch; `plan` (from `make_plan`) spares the host read of the batch layout.

    Returns out `[T, H, Dv]` and indices `[T, G, topk]` int32; rows past the last request get 0 and -1.
    """
    out, _ = check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)
    plan = plan_or_make(plan, query_start_loc, seq_lens, q.shape[0])
    indices = torch.full((q.shape[0], k_cache.shape[1], topk), -1, dtype=torch.int32, device=q.device)
    out[plan.num_tokens:].zero_()

    def select(z, lse, limit):
        return select_blocks(z, lse, limit, sparse_block_size, topk)

    oracle_attention_rows(q, k_cache, v_cache, block_table, plan, out, indices, scale=scale, select=select)
    return out, indices
