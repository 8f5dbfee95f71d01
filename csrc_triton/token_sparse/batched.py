# SPDX-License-Identifier: Apache-2.0
"""Token-sparse paged attention as batched PyTorch: the CPU serving path (same contract as the kernel).

Decode rows of all requests gather their selected tokens together; a prefill
run attends its own keys under the token mask (see `paged_batch`).
"""

import torch

from csrc_triton.paged_args import kv_scaled
from csrc_triton.paged_batch import BatchPlan, bind_sparse, sparse_attention


def token_positions(tokens: torch.Tensor, pos: torch.Tensor):
    """`[n, G, S]` selected positions and row positions `[n]` -> positions and validity (`-1` and `> pos` dropped)."""
    tokens = tokens.long()
    return tokens, (tokens >= 0) & (tokens <= pos[:, None, None])


def token_mask(tokens: torch.Tensor, pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """`[n, G, S]` selected positions, row positions `[n]` -> `[n, G, num_keys]` bool mask of the attended keys."""
    positions, valid = token_positions(tokens, pos)
    slots = torch.where(valid & (positions < num_keys), positions, num_keys)
    hit = torch.zeros(*tokens.shape[:2], num_keys + 1, dtype=torch.bool, device=tokens.device)
    return hit.scatter_(-1, slots, True)[..., :num_keys]


@kv_scaled
def token_sparse_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, token_indices, *,
                                   scale, sinks=None, out=None, plan: BatchPlan | None = None):
    """`token_sparse_attention` in batched PyTorch; `plan` (from `make_plan`) spares the host read of the batch."""

    def select(plan, rows):
        return token_positions(token_indices[rows], plan.row_pos[rows])

    def mask(plan, start, end, num_keys):
        return token_mask(token_indices[start:end], plan.row_pos[start:end], num_keys)

    return sparse_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale, sinks=sinks,
                            out=out, plan=plan, ids=token_indices, span=1, select=select, mask=mask)


def bind_token_sparse(q, k_cache, v_cache, *, scale, sinks=None):
    """The C++ kernel of `token_sparse_attention_batched` bound to one layer (`paged_batch.bind_sparse`), or None."""
    return bind_sparse(q, k_cache, v_cache, span=1, scale=scale, sinks=sinks)
