# SPDX-License-Identifier: Apache-2.0
"""Block-sparse cases: inputs (paged batch, strided q `[T, H, D]`, sinks `[H]`), `[T, G, k]` block ids, the call."""

import torch

from tests.kernel_utils import DEVICE, Case, make_case_inputs, random_blocks  # noqa: F401 (the cases' ids)

CASES = [
    # prefill, chunked prefill and decode rows in one batch; lengths around block and page ends
    Case([7, 1, 1, 4], [40, 33, 16, 64], pad_tokens=2),
    # MQA; a block spans two pages; NHD physical layout
    Case([5, 1, 3], [21, 80, 48], num_kv_heads=1, head_dim=64, page_size=8, layout="nhd"),
    # two blocks share one page; more selected slots than visible blocks (padding -1)
    Case([17, 1], [17, 129], page_size=32, topk=4),
    # decode only, blocks of two pages
    Case([1, 1, 1, 1], [1, 31, 32, 97], block_size=32, topk=2),
    # 3 heads per group, head dim and block size not powers of two
    Case([6, 1], [50, 100], num_heads=6, head_dim=80, block_size=48, topk=2, layout="nhd", pad_tokens=1),
    # head dim 256 takes 32-key tiles: four tiles per 128-position block
    Case([3, 1], [300, 200], num_heads=2, num_kv_heads=1, head_dim=256, block_size=128, topk=2),
]

# SPEC §2.6: a value head dim of its own (the papers' 192 / 128, scaled to interpreter sizes), both ways
V_CASES = [
    Case([7, 1, 1, 4], [40, 33, 16, 64], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([5, 1, 3], [21, 80, 48], num_kv_heads=1, head_dim=32, head_dim_v=64, page_size=8, layout="nhd"),
]


def make_inputs(case: Case, dtype, seed=0):
    return make_case_inputs(case, dtype, seed, sinks=True)


def all_blocks(batch, num_kv_heads, block_size):
    """`[T, G, max blocks]`: every block up to each query, ascending, -1 padded."""
    width = max(-(-s // block_size) for s in batch.seq_lens)
    ids = torch.full((batch.num_tokens, num_kv_heads, width), -1, dtype=torch.int32)
    for t, pos in enumerate(batch.positions()):
        if pos >= 0:
            ids[t, :, : pos // block_size + 1] = torch.arange(pos // block_size + 1, dtype=torch.int32)
    return ids.to(DEVICE)


def run(fn, batch, q, ids, case, sinks, out=None):
    return fn(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t, ids,
              scale=case.head_dim ** -0.5, sparse_block_size=case.block_size, sinks=sinks, out=out)
