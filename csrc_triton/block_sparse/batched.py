# SPDX-License-Identifier: Apache-2.0
"""Block-sparse paged attention as batched PyTorch: the CPU serving path (same contract as the kernel).

Decode rows of all requests gather their selected blocks' keys together; a
prefill run attends its own keys under the block mask (see `paged_batch`).
"""

import torch

from csrc_triton.paged_args import kv_scaled
from csrc_triton.paged_batch import BatchPlan, bind_sparse, sparse_attention


def block_positions(blocks: torch.Tensor, pos: torch.Tensor, block_size: int):
    """`[n, G, K]` block ids and row positions `[n]` -> key positions and validity, both `[n, G, K * block_size]`."""
    blocks = blocks.long()
    positions = (blocks[..., None] * block_size + torch.arange(block_size, device=blocks.device)).flatten(2)
    valid = (blocks >= 0).repeat_interleave(block_size, dim=2) & (positions <= pos[:, None, None])
    return positions, valid


def block_mask(blocks: torch.Tensor, pos: torch.Tensor, block_size: int, num_keys: int) -> torch.Tensor:
    """`[n, G, K]` block ids and row positions `[n]` -> `[n, G, num_keys]` bool: key j in a selected block, j <= pos."""
    num_blocks = -(-num_keys // block_size)
    blocks = blocks.long()
    slots = torch.where((blocks >= 0) & (blocks < num_blocks), blocks, num_blocks)
    hit = torch.zeros(*blocks.shape[:2], num_blocks + 1, dtype=torch.bool, device=blocks.device)
    hit.scatter_(-1, slots, True)
    j = torch.arange(num_keys, device=blocks.device)
    return hit[..., j // block_size] & (j <= pos[:, None, None])


@kv_scaled
def block_sparse_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, block_indices, *,
                                   scale, sparse_block_size, sinks=None, out=None, plan: BatchPlan | None = None):
    """`block_sparse_attention` in batched PyTorch; `plan` (from `make_plan`) spares the host read of the batch."""

    def select(plan, rows):
        return block_positions(block_indices[rows], plan.row_pos[rows], sparse_block_size)

    def mask(plan, start, end, num_keys):
        return block_mask(block_indices[start:end], plan.row_pos[start:end], sparse_block_size, num_keys)

    return sparse_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale, sinks=sinks,
                            out=out, plan=plan, ids=block_indices, span=sparse_block_size, select=select,
                            mask=mask)


def bind_block_sparse(q, k_cache, v_cache, *, scale, sparse_block_size, sinks=None):
    """The C++ kernel of `block_sparse_attention_batched` bound to one layer (`paged_batch.bind_sparse`), or None."""
    return bind_sparse(q, k_cache, v_cache, span=sparse_block_size, scale=scale, sinks=sinks)
