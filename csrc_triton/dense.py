# SPDX-License-Identifier: Apache-2.0
"""Plain causal attention on the HySparse kernels: a full layer with no oracle (SPEC §3.1 without Eq. 3).

HySparse2's self-decoder full layer and a HySparse full layer with no sparse
followers attend like any dense layer. On the CPU they run here rather than
on vLLM's kernel because the tiled oracle kernel walks a prompt that several
decode rows share once for all of them (`oracle/cpu_tiled.cpp`), where vLLM's
kernel reads it once per request: an oracle with one block spanning every key
and an empty top-k, whose selection costs one `exp` per head and row. Where
that kernel does not apply (FP8 or 16-bit caches, `v_head_dim != head_dim`,
no compiler), the oracle's PyTorch path runs the same call. The Triton path is
the token oracle's kernel with an empty top-k and a one-token window.
"""

import torch

from csrc_triton.oracle.batched import bind_oracle, oracle_attention_batched
from csrc_triton.paged_args import kv_scaled
from csrc_triton.paged_batch import BatchPlan

# One oracle block as wide as any context (positions are int32): the block scores reduce to one per row and head.
ONE_BLOCK = 1 << 31


@kv_scaled
def dense_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, out=None,
                            plan: BatchPlan | None = None) -> torch.Tensor:
    """Causal paged attention of every row of a step, no sink, no selection (CPU serving path).

    Args and layout as `oracle_attention_batched` (q `[T, H, D]`, caches `[pages, G, page, D]` /
    `[pages, G, page, Dv]`); `plan` (from `make_plan`) spares the host read of the batch.
    Returns out `[T, H, Dv]`; rows past the last request get 0.
    """
    return oracle_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale,
                                    sparse_block_size=ONE_BLOCK, topk=0, out=out, plan=plan)[0]


def bind_dense(q, k_cache, v_cache, *, scale):
    """The C++ kernel of `dense_attention_batched` bound to one layer (`oracle.batched.bind_oracle`), or None.

    Returns `run(q [n, H, D], block_table, plan, out [n, H, Dv], ids=None)`.
    """
    run = bind_oracle(q, k_cache, v_cache, sparse_block_size=ONE_BLOCK, topk=0, scale=scale)
    if run is None:
        return None
    groups = k_cache.shape[1]

    def dense_run(q, block_table, plan, out, ids=None):
        run(q, block_table, plan, out, torch.empty(q.shape[0], groups, 0, dtype=torch.int32))

    return dense_run


@kv_scaled
def dense_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, out=None,
                    max_seq_len=None) -> torch.Tensor:
    """`dense_attention_batched` in Triton: the token oracle with an empty top-k and a one-token window."""
    from csrc_triton.token_oracle.kernel import token_oracle_attention  # imports triton

    return token_oracle_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale,
                                  topk_tokens=0, recent_window=1, out=out, max_seq_len=max_seq_len)[0]
