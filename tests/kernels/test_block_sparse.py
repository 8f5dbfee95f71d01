# SPDX-License-Identifier: Apache-2.0
"""Block-sparse paged attention: naive vs the dense reference ops, Triton vs naive, all blocks vs dense."""


import pytest
import torch

from csrc_triton.block_sparse import block_sparse_attention, block_sparse_attention_naive
from tests.kernel_utils import DEVICE, Case, dense_causal, make_paged_batch, nan_like, nan_out
from vllm_hysparse.reference import ops

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


def make_inputs(case: Case, dtype, seed=0):
    batch = make_paged_batch(case.q_lens, case.seq_lens, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                             page_size=case.page_size, dtype=dtype, seed=seed, layout=case.layout,
                             pad_tokens=case.pad_tokens, head_dim_v=case.head_dim_v)
    g = torch.Generator().manual_seed(seed + 1)
    # a strided q: every other head of a wider projection output
    q = torch.randn(batch.num_tokens, 2 * case.num_heads, case.head_dim, generator=g).to(dtype)[:, ::2]
    sinks = torch.randn(case.num_heads, generator=g) + 1.0
    return batch, q.to(DEVICE), sinks.to(DEVICE)


def random_blocks(batch, num_kv_heads, block_size, topk, seed=0):
    """`[T, G, topk]` int32: per row and group a random subset of the blocks up to the query, ascending, -1 padded.

    Rows also pick, at random, blocks after the query but inside the sequence: the kernel must mask them.
    """
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.full((batch.num_tokens, num_kv_heads, topk), -1, dtype=torch.int32)
    seq_of_row = [s for q_len, s in zip(batch.q_lens, batch.seq_lens) for _ in range(q_len)]
    for t, pos in enumerate(batch.positions()):
        if pos < 0:
            continue
        num_blocks = pos // block_size + 1
        if torch.rand((), generator=g) < 0.2:
            num_blocks = -(-seq_of_row[t] // block_size)
        for h in range(num_kv_heads):
            n = int(torch.randint(0, min(topk, num_blocks) + 1, (), generator=g))
            chosen = torch.randperm(num_blocks, generator=g)[:n].sort().values
            ids[t, h, :n] = chosen.to(torch.int32)
    return ids.to(DEVICE)


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


@pytest.mark.parametrize("case", CASES[:3], ids=str)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_naive_matches_reference(case, use_sinks):
    batch, q, sinks = make_inputs(case, torch.float32)
    sinks = sinks if use_sinks else None
    ids = random_blocks(batch, case.num_kv_heads, case.block_size, case.topk)
    got = run(block_sparse_attention_naive, batch, q, ids, case, sinks)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        ref = ops.block_sparse_attention(q[None, rows], batch.keys[r][None], batch.values[r][None],
                                         ids[None, rows].long(), case.block_size, case.head_dim ** -0.5, sinks)
        torch.testing.assert_close(got[rows], ref[0], atol=1e-5, rtol=1e-5)
    assert (got[sum(batch.q_lens):] == 0).all()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_naive(case, use_sinks, dtype):
    batch, q, sinks = make_inputs(case, dtype)
    sinks = sinks if use_sinks else None
    ids = random_blocks(batch, case.num_kv_heads, case.block_size, case.topk)
    ref = run(block_sparse_attention_naive, batch, q, ids, case, sinks)
    out = nan_like(q)
    got = run(block_sparse_attention, batch, q, ids, case, sinks, out=out)
    assert got is out and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=str)
def test_all_blocks_is_dense_causal(case):
    batch, q, sinks = make_inputs(case, torch.float32, seed=3)
    ids = all_blocks(batch, case.num_kv_heads, case.block_size)
    ref = dense_causal(batch, q, case.head_dim ** -0.5, sinks).float().to(DEVICE)
    for fn in (block_sparse_attention, block_sparse_attention_naive):
        torch.testing.assert_close(run(fn, batch, q, ids, case, sinks, out=nan_like(q)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_sinks", [False, True])
def test_empty_selection_is_zero(use_sinks):
    case = CASES[0]
    batch, q, sinks = make_inputs(case, torch.float32)
    ids = torch.full((batch.num_tokens, case.num_kv_heads, 2), -1, dtype=torch.int32, device=DEVICE)
    got = run(block_sparse_attention, batch, q, ids, case, sinks if use_sinks else None, out=nan_like(q))
    assert (got == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is wrong in the Triton interpreter")
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=str)
def test_kernel_bf16(case):
    batch, q, sinks = make_inputs(case, torch.bfloat16)
    ids = random_blocks(batch, case.num_kv_heads, case.block_size, case.topk)
    ref = run(block_sparse_attention_naive, batch, q, ids, case, sinks)
    got = run(block_sparse_attention, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


def test_long_context_decode():
    """Production-sized selection (16 blocks of 64) deep in a 4K context: cost is O(selected), not O(context)."""
    case = Case([1, 1], [4096, 3000], num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=64, topk=16)
    batch, q, sinks = make_inputs(case, torch.float16)
    ids = random_blocks(batch, case.num_kv_heads, case.block_size, case.topk)
    ref = run(block_sparse_attention_naive, batch, q, ids, case, sinks)
    got = run(block_sparse_attention, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=4e-3, rtol=4e-3)


# SPEC §2.6: a value head dim of its own (the papers' 192 / 128, scaled to interpreter sizes), both ways
V_CASES = [
    Case([7, 1, 1, 4], [40, 33, 16, 64], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([5, 1, 3], [21, 80, 48], num_kv_heads=1, head_dim=32, head_dim_v=64, page_size=8, layout="nhd"),
]


@pytest.mark.parametrize("case", V_CASES, ids=str)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_separate_v_head_dim(case, use_sinks):
    """Naive vs the dense reference ops, Triton vs naive, all blocks vs explicit dense attention; scale by D."""
    batch, q, sinks = make_inputs(case, torch.float32)
    sinks = sinks if use_sinks else None
    assert batch.v_cache.shape[-1] == case.head_dim_v != case.head_dim
    ids = random_blocks(batch, case.num_kv_heads, case.block_size, case.topk)
    ref = run(block_sparse_attention_naive, batch, q, ids, case, sinks)
    assert ref.shape == (batch.num_tokens, case.num_heads, case.head_dim_v)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        want = ops.block_sparse_attention(q[None, rows], batch.keys[r][None], batch.values[r][None],
                                          ids[None, rows].long(), case.block_size, case.head_dim ** -0.5, sinks)
        torch.testing.assert_close(ref[rows], want[0], atol=1e-5, rtol=1e-5)
    got = run(block_sparse_attention, batch, q, ids, case, sinks, out=nan_out(batch, q))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    every = all_blocks(batch, case.num_kv_heads, case.block_size)
    dense = dense_causal(batch, q, case.head_dim ** -0.5, sinks).float().to(DEVICE)
    torch.testing.assert_close(run(block_sparse_attention, batch, q, every, case, sinks), dense, atol=1e-5, rtol=1e-5)
