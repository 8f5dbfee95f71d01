# SPDX-License-Identifier: Apache-2.0
"""Token-sparse paged attention: naive vs the dense reference ops, Triton vs naive, all tokens vs dense."""

from dataclasses import dataclass

import pytest
import torch

from csrc_triton.token_sparse import token_sparse_attention, token_sparse_attention_naive
from tests.kernel_utils import DEVICE, TokenCase, dense_causal, make_paged_batch, nan_like, nan_out
from vllm_hysparse.reference import ops


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


def make_inputs(case: Case, dtype, seed=0):
    batch = make_paged_batch(case.q_lens, case.seq_lens, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                             page_size=case.page_size, dtype=dtype, seed=seed, layout=case.layout,
                             pad_tokens=case.pad_tokens, head_dim_v=case.head_dim_v)
    g = torch.Generator().manual_seed(seed + 1)
    # a strided q: every other head of a wider projection output
    q = torch.randn(batch.num_tokens, 2 * case.num_heads, case.head_dim, generator=g).to(dtype)[:, ::2]
    sinks = torch.randn(case.num_heads, generator=g) + 1.0
    return batch, q.to(DEVICE), sinks.to(DEVICE)


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


def all_tokens(batch, num_kv_heads):
    """`[T, G, max seq_len]`: every position up to each query, ascending, -1 padded."""
    ids = torch.full((batch.num_tokens, num_kv_heads, max(batch.seq_lens)), -1, dtype=torch.int32)
    for t, pos in enumerate(batch.positions()):
        if pos >= 0:
            ids[t, :, : pos + 1] = torch.arange(pos + 1, dtype=torch.int32)
    return ids.to(DEVICE)


def run(fn, batch, q, ids, case, sinks, out=None):
    return fn(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t, ids,
              scale=case.head_dim ** -0.5, sinks=sinks, out=out)


@pytest.mark.parametrize("case", CASES[:3], ids=str)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_naive_matches_reference(case, use_sinks):
    batch, q, sinks = make_inputs(case, torch.float32)
    sinks = sinks if use_sinks else None
    ids = random_tokens(batch, case.num_kv_heads, case.window, case.topk)
    got = run(token_sparse_attention_naive, batch, q, ids, case, sinks)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        ref = ops.token_sparse_attention(q[None, rows], batch.keys[r][None], batch.values[r][None],
                                         ids[None, rows].long(), case.head_dim ** -0.5, sinks)
        torch.testing.assert_close(got[rows], ref[0], atol=1e-5, rtol=1e-5)
    assert (got[sum(batch.q_lens):] == 0).all()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_naive(case, use_sinks, dtype):
    batch, q, sinks = make_inputs(case, dtype)
    sinks = sinks if use_sinks else None
    ids = random_tokens(batch, case.num_kv_heads, case.window, case.topk)
    ref = run(token_sparse_attention_naive, batch, q, ids, case, sinks)
    out = nan_like(q)
    got = run(token_sparse_attention, batch, q, ids, case, sinks, out=out)
    assert got is out and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=str)
def test_all_tokens_is_dense_causal(case):
    batch, q, sinks = make_inputs(case, torch.float32, seed=3)
    ids = all_tokens(batch, case.num_kv_heads)
    ref = dense_causal(batch, q, case.head_dim ** -0.5, sinks).float().to(DEVICE)
    for fn in (token_sparse_attention, token_sparse_attention_naive):
        torch.testing.assert_close(run(fn, batch, q, ids, case, sinks, out=nan_like(q)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_sinks", [False, True])
def test_empty_selection_is_zero(use_sinks):
    case = CASES[0]
    batch, q, sinks = make_inputs(case, torch.float32)
    ids = torch.full((batch.num_tokens, case.num_kv_heads, 3), -1, dtype=torch.int32, device=DEVICE)
    got = run(token_sparse_attention, batch, q, ids, case, sinks if use_sinks else None, out=nan_like(q))
    assert (got == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is wrong in the Triton interpreter")
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=str)
def test_kernel_bf16(case):
    batch, q, sinks = make_inputs(case, torch.bfloat16)
    ids = random_tokens(batch, case.num_kv_heads, case.window, case.topk)
    ref = run(token_sparse_attention_naive, batch, q, ids, case, sinks)
    got = run(token_sparse_attention, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


def test_long_context_decode():
    """Production-sized selection (top-1024 ∪ window 128) in a 4K context: cost is O(selected), not O(context)."""
    case = Case([1, 1], [4096, 3000], num_heads=8, num_kv_heads=2, head_dim=64, window=128, topk=1024)
    batch, q, sinks = make_inputs(case, torch.float16)
    ids = random_tokens(batch, case.num_kv_heads, case.window, case.topk)
    ref = run(token_sparse_attention_naive, batch, q, ids, case, sinks)
    got = run(token_sparse_attention, batch, q, ids, case, sinks, out=nan_like(q))
    torch.testing.assert_close(got, ref, atol=4e-3, rtol=4e-3)


# SPEC §2.6: a value head dim of its own, both ways
V_CASES = [
    Case([7, 1, 1, 4], [40, 33, 16, 64], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([1, 1, 1, 1], [1, 31, 32, 150], num_kv_heads=1, head_dim=32, head_dim_v=64, page_size=32, window=20,
         topk=80),
]


@pytest.mark.parametrize("case", V_CASES, ids=str)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_separate_v_head_dim(case, use_sinks):
    """Naive vs the dense reference ops, Triton vs naive, all tokens vs explicit dense attention; scale by D."""
    batch, q, sinks = make_inputs(case, torch.float32)
    sinks = sinks if use_sinks else None
    ids = random_tokens(batch, case.num_kv_heads, case.window, case.topk)
    ref = run(token_sparse_attention_naive, batch, q, ids, case, sinks)
    assert ref.shape == (batch.num_tokens, case.num_heads, case.head_dim_v)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        want = ops.token_sparse_attention(q[None, rows], batch.keys[r][None], batch.values[r][None],
                                          ids[None, rows].long(), case.head_dim ** -0.5, sinks)
        torch.testing.assert_close(ref[rows], want[0], atol=1e-5, rtol=1e-5)
    got = run(token_sparse_attention, batch, q, ids, case, sinks, out=nan_out(batch, q))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    dense = dense_causal(batch, q, case.head_dim ** -0.5, sinks).float().to(DEVICE)
    every = all_tokens(batch, case.num_kv_heads)
    torch.testing.assert_close(run(token_sparse_attention, batch, q, every, case, sinks), dense, atol=1e-5, rtol=1e-5)
