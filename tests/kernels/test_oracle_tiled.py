# SPDX-License-Identifier: Apache-2.0
"""The C++ tiled oracle (`csrc_triton/oracle/cpu_tiled.cpp`) against the naive PyTorch twin.

Every row of a step in one pass: decode rows, prefill runs, chunked prefill (rows that are the last
of a longer context), several requests, GQA groups, padding rows; outputs and index buffers are
poisoned first, inputs drawn from a printed seed.
"""

import pytest
import torch

from csrc_triton.oracle import oracle_attention_naive
from csrc_triton.oracle.batched import oracle_attention_batched, tiled_kernel
from tests.kernel_utils import Case, nan_like, share_pages
from tests.kernels import oracle_cases as orc

POISON = 12345
# cases of the oracle tests (`oracle_cases`) whose caches are vLLM's interleaved pages (the layout the kernel
# reads), and more: chunked prefill runs of several requests (GQA 12/4, the `small` preset's shape), a tile of
# 16 rows split over requests, MQA, a block shorter than a key tile and one longer than a page, tiles of 256 rows
CASES = [c for c in orc.CASES + [orc.DECODE, orc.LONG] if c.layout == "hnd"] + [
    Case([37, 1, 50, 1], [300, 129, 50, 2], num_heads=12, num_kv_heads=4, head_dim=64, block_size=64, topk=3,
             page_size=32, pad_tokens=3),
    Case([17, 16, 1], [17, 80, 900], num_heads=12, num_kv_heads=1, head_dim=64, block_size=16, topk=5),
    Case([5, 33], [260, 33], num_heads=4, num_kv_heads=2, head_dim=32, block_size=96, topk=2, page_size=64),
    # a prefill run taller than the tallest tile (256 rows: `tile_rows` at one or two threads) beside a decode row
    Case([300, 1], [700, 90], num_heads=12, num_kv_heads=4, head_dim=64, block_size=64, topk=4, page_size=32),
]


def run_tiled(case, batch, q, indices=None):
    out = nan_like(q)
    got = oracle_attention_batched(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
                                   batch.seq_lens_t, scale=case.head_dim ** -0.5, sparse_block_size=case.block_size,
                                   topk=case.topk, out=out, indices=indices, return_block_scores=True)
    assert got[0] is out
    return got


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tiled_matches_naive(case):
    seed = 1000 + CASES.index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    assert tiled_kernel(q, batch.k_cache, batch.v_cache) is not None, "the C++ tiled oracle must run on this case"
    ref = orc.run(oracle_attention_naive, batch, q, case)
    indices = torch.full((q.shape[0], case.num_kv_heads, case.topk), POISON, dtype=torch.int32)
    got = run_tiled(case, batch, q, indices)
    assert got[1] is indices, "the block ids go straight into the given buffer"
    orc.check_against_naive(case, torch.float32, got, ref, batch)
    n = sum(batch.q_lens)
    matched = (got[1][:n] == ref[1][:n]).float().mean().item()
    print(f"ids equal to the naive twin's: {matched:.4f}")
    assert matched > 0.98


def test_tiled_ties_go_to_smaller_blocks():
    """q = 0: every logit is 0, all visible blocks tie and the first topk of them win."""
    case = Case([100, 1, 20], [100, 37, 300], num_heads=6, num_kv_heads=2, block_size=16, topk=3)
    batch, q = orc.make_inputs(case, torch.float32)
    _, ids, scores = run_tiled(case, batch, torch.zeros_like(q))
    for t, pos in enumerate(batch.positions()):
        visible = pos // case.block_size + 1
        want = list(range(min(visible, case.topk))) + [-1] * max(0, case.topk - visible)
        assert ids[t].tolist() == [want] * case.num_kv_heads, (t, pos)
        # every visible block scores exp(0 - log(pos + 1)); none past them
        torch.testing.assert_close(scores[t, :, :visible], torch.full((2, visible), 1.0 / (pos + 1)))
        assert (scores[t, :, visible:] == 0).all()


def test_tiled_index_buffer_rows_keep_their_stride():
    """A view of a wider index buffer (the layer's, `[max_tokens, G, topk]`) is written in place."""
    case = CASES[-3]
    batch, q = orc.make_inputs(case, torch.float32, seed=7)
    buffer = torch.full((q.shape[0] + 9, case.num_kv_heads, case.topk), POISON, dtype=torch.int32)
    _, ids, _ = run_tiled(case, batch, q, indices=buffer[:q.shape[0]])
    ref = orc.run(oracle_attention_naive, batch, q, case)
    n = sum(batch.q_lens)
    assert ids.data_ptr() == buffer.data_ptr()
    assert (buffer[:n] == ref[1][:n]).float().mean() > 0.98
    assert (buffer[n:q.shape[0]] == -1).all() and (buffer[q.shape[0]:] == POISON).all()


# Decode rows on shared prefixes (vLLM's prefix cache gives requests the same leading pages): request -> (the
# request whose pages it starts with, how many). Request 0 is a prefill run. Requests 1-5 share 5 pages of
# request 1 (request 4's context ends where the prefix does: no tail of its own; request 5 shares only 3
# of them, which still holds half the cluster's prefix); requests 6 and 7 share 2 pages; request 8 shares none.
SHARED = [
    (Case([20, 1, 1, 1, 1, 1, 1, 1, 1], [20, 400, 330, 371, 320, 290, 130, 150, 200], num_heads=12, num_kv_heads=4,
          head_dim=64, block_size=64, topk=3, page_size=64, pad_tokens=2),
     {2: (1, 5), 3: (1, 5), 4: (1, 5), 5: (1, 3), 7: (6, 2)}),
    # pages shorter than a block (the block at the prefix's end is split between the two parts), MQA, k = 16
    (Case([1, 1, 1, 1], [1100, 700, 1060, 97], num_heads=8, num_kv_heads=1, head_dim=64, block_size=64, topk=16,
          page_size=16), {1: (0, 40), 2: (0, 63)}),
    # pages longer than a block
    (Case([1, 1, 1], [300, 260, 299], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, topk=4,
          page_size=128), {1: (0, 2), 2: (0, 2)}),
    # long prefixes, one KV group: the prefix is cut into parts along its keys (PREFIX_PART_MIN_KEYS), 8,192
    # keys into up to four, 6,016 into two of 3,008 keys, which cuts a block of 128 between them
    (Case([1, 1, 1, 1], [8300, 8200, 8192, 300], num_heads=8, num_kv_heads=1, head_dim=64, block_size=64, topk=16,
          page_size=128), {1: (0, 64), 2: (0, 64)}),
    (Case([1, 1, 1], [6100, 6050, 6016], num_heads=4, num_kv_heads=1, head_dim=64, block_size=128, topk=8,
          page_size=128), {1: (0, 47), 2: (0, 47)}),
    # lone decode rows of long contexts, too few tasks for the threads: each row's own keys are cut the same way
    (Case([1, 1], [9000, 5000], num_heads=8, num_kv_heads=1, head_dim=64, block_size=64, topk=16, page_size=128),
     {}),
]


@pytest.mark.parametrize("case, shares", SHARED, ids=[str(c) for c, _ in SHARED])
def test_tiled_shared_prefix(case, shares):
    """Rows whose block tables start with the same pages are walked once for the prefix (long prefixes, and lone
    long rows, in parts along their keys), then per row: the same outputs, scores and selections as the naive twin
    reading each row's own pages."""
    seed = 2000 + [c for c, _ in SHARED].index(case)
    print(f"seed {seed}")
    batch, q = orc.make_inputs(case, torch.float32, seed=seed)
    share_pages(batch, shares)
    ref = orc.run(oracle_attention_naive, batch, q, case)
    got = run_tiled(case, batch, q)
    orc.check_against_naive(case, torch.float32, got, ref, batch)
    n = sum(batch.q_lens)
    matched = (got[1][:n] == ref[1][:n]).float().mean().item()
    print(f"ids equal to the naive twin's: {matched:.4f}")
    assert matched > 0.98
