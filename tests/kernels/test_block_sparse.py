# SPDX-License-Identifier: Apache-2.0
"""Block-sparse paged attention: naive vs the dense reference ops, Triton vs naive, all blocks vs dense."""


import pytest
import torch

from csrc_triton.block_sparse import block_sparse_attention, block_sparse_attention_naive
from tests.kernel_utils import DEVICE, Case, dense_causal, nan_like, nan_out
from tests.kernels.block_sparse_cases import CASES, V_CASES, all_blocks, make_inputs, random_blocks, run
from vllm_hysparse.reference import ops


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
