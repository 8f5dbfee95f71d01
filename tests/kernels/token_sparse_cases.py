# SPDX-License-Identifier: Apache-2.0
"""Token-sparse cases: inputs (paged batch, strided q `[T, H, D]`, sinks `[H]`), `[T, G, w + k]` token ids, the call."""

from dataclasses import dataclass

import torch

from tests.kernel_utils import DEVICE, TokenCase, make_case_inputs


@dataclass
class Case(TokenCase):
    topk: int = 12


CASES = [
    # prefill, chunked prefill and decode rows in one batch; lengths around page ends
    Case([7, 1, 1, 4], [40, 33, 16, 64], pad_tokens=2),
    # MQA, small pages, NHD layout; S = 64 fills exactly one tile
    Case([5, 1, 3], [21, 80, 48], num_kv_heads=1, head_dim=64, page_size=8, window=4, topk=60, layout="nhd"),
    # decode only; S = 100 spans two tiles, the second mostly padding
    Case([1, 1, 1, 1], [1, 31, 32, 150], page_size=32, window=20, topk=80),
    # 3 heads per group, head dim not a power of two
    Case([6, 1], [50, 100], num_heads=6, head_dim=80, window=16, topk=16, layout="nhd", pad_tokens=1),
    # head dim 256 takes 32-key tiles
    Case([2, 1], [100, 70], num_heads=2, num_kv_heads=1, head_dim=256, window=16, topk=40),
]

# SPEC §2.6: a value head dim of its own, both ways
V_CASES = [
    Case([7, 1, 1, 4], [40, 33, 16, 64], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([1, 1, 1, 1], [1, 31, 32, 150], num_kv_heads=1, head_dim=32, head_dim_v=64, page_size=32, window=20,
         topk=80),
]


def make_inputs(case: Case, dtype, seed=0):
    return make_case_inputs(case, dtype, seed, sinks=True)


def random_tokens(batch, num_kv_heads, window, topk, seed=0):
    """`[T, G, window + topk]` int32: per row and group, window ∪ random earlier positions; ascending, -1 padded.

    A fifth of the rows instead take a random subset of all positions of the sequence, window not forced:
    positions after the query break the interface's promise, and the kernel must still ignore them.
    """
    g = torch.Generator().manual_seed(seed + 2)
    width = window + topk
    ids = torch.full((batch.num_tokens, num_kv_heads, width), -1, dtype=torch.int32)
    seq_of_row = [s for q_len, s in zip(batch.q_lens, batch.seq_lens) for _ in range(q_len)]
    for t, pos in enumerate(batch.positions()):
        if pos < 0:
            continue
        for h in range(num_kv_heads):
            if torch.rand((), generator=g) < 0.2:
                n = int(torch.randint(0, min(width, seq_of_row[t]) + 1, (), generator=g))
                chosen = torch.randperm(seq_of_row[t], generator=g)[:n]
            else:
                start = max(0, pos - window + 1)
                earlier = torch.randperm(start, generator=g)[:topk]
                chosen = torch.cat([earlier, torch.arange(start, pos + 1)])
            chosen = chosen.sort().values
            ids[t, h, : len(chosen)] = chosen.to(torch.int32)
    return ids.to(DEVICE)


def run(fn, batch, q, ids, case, sinks, out=None):
    return fn(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t, ids,
              scale=case.head_dim ** -0.5, sinks=sinks, out=out)
