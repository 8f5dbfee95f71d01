# SPDX-License-Identifier: Apache-2.0
"""Oracle attention: the naive paged version against the dense reference ops, the Triton kernels against the naive."""


import pytest
import torch

from csrc_triton.oracle import oracle_attention, oracle_attention_naive
from csrc_triton.oracle.kernel import oracle_fwd
from tests.kernel_utils import Case, nan_like, nan_out
from tests.kernels.oracle_cases import (
    CASES,
    DECODE,
    LONG,
    V_CASES,
    assert_same_topk,
    check_against_naive,
    make_inputs,
    run,
)
from vllm_hysparse.reference import ops


@pytest.mark.parametrize("case", CASES[:3] + [CASES[5], LONG], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_naive_matches_reference(case, dtype):
    batch, q = make_inputs(case, dtype)
    scale = case.head_dim ** -0.5
    out, ids, scores = run(oracle_attention_naive, batch, q, case)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    for r, row0, _ in batch.rows():
        if batch.q_lens[r] == 0:
            continue
        rows = slice(row0, row0 + batch.q_lens[r])
        qr, k, v = q[None, rows], batch.keys[r][None], batch.values[r][None]
        torch.testing.assert_close(out[rows], ops.dense_attention(qr, k, v, scale)[0], atol=tol, rtol=tol)
        ref_ids = ops.oracle_block_topk(qr, k, scale, case.block_size, case.topk)[0]
        assert (ids[rows] == ref_ids).all()
        ref_scores = ops.oracle_block_scores(ops.attention_logits(qr, k, scale), case.block_size, case.num_kv_heads)
        nb = ref_scores.shape[-1]
        torch.testing.assert_close(scores[rows, :, :nb], ref_scores[0].transpose(0, 1), atol=1e-6, rtol=1e-5)
        assert (scores[rows, :, nb:] == 0).all()
    n = sum(batch.q_lens)
    assert (out[n:] == 0).all() and (ids[n:] == -1).all()


@pytest.mark.parametrize("fn", [oracle_attention_naive, oracle_attention], ids=["naive", "triton"])
def test_ties_go_to_smaller_blocks(fn):
    """q = 0 makes every logit 0: all visible blocks tie, and the first topk of them win."""
    case = Case([100, 1], [100, 37], block_size=16, topk=3)
    batch, q = make_inputs(case, torch.float32)
    _, ids, scores = run(fn, batch, torch.zeros_like(q), case)
    for t, pos in enumerate(batch.positions()):
        visible = pos // case.block_size + 1
        want = list(range(min(visible, case.topk))) + [-1] * max(0, case.topk - visible)
        assert ids[t].tolist() == [want] * case.num_kv_heads, (t, pos)
        # every visible block holds the row max: S = 1 / (number of visible keys)
        torch.testing.assert_close(scores[t, :, :visible], torch.full_like(scores[t, :, :visible], 1 / (pos + 1)))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_oracle_attention(case, dtype):
    batch, q = make_inputs(case, dtype)
    ref = run(oracle_attention_naive, batch, q, case)
    out = nan_like(q)
    got = run(oracle_attention, batch, q, case, out=out)
    assert got[0] is out
    check_against_naive(case, dtype, got, ref, batch)


@pytest.mark.parametrize("num_splits", [None, 0, 1, 4])
def test_decode(num_splits):
    """Split-KV (the launcher's choice for this batch, 1 and 4 splits) and the prefill kernel on decode rows."""
    batch, q = make_inputs(DECODE, torch.float16)
    ref = run(oracle_attention_naive, batch, q, DECODE)
    got = run(oracle_fwd, batch, q, DECODE, out=nan_like(q), num_splits=num_splits)
    check_against_naive(DECODE, torch.float16, got, ref, batch)


@pytest.mark.parametrize("num_splits", [0, 2])
def test_long_context(num_splits):
    batch, q = make_inputs(LONG, torch.float16, seed=1)
    ref = run(oracle_attention_naive, batch, q, LONG)
    got = run(oracle_fwd, batch, q, LONG, out=nan_like(q), num_splits=num_splits)
    check_against_naive(LONG, torch.float16, got, ref, batch)
    # 1100 keys are 18 blocks: all 16 slots are used
    assert (got[1][0] >= 0).all()


def test_split_kv_any_batch():
    """The split-KV kernel is exact for prefill rows too (each row finds its own request)."""
    case = Case([9, 3, 0, 1], [9, 40, 5, 17], block_size=32, topk=2, pad_tokens=1)
    batch, q = make_inputs(case, torch.float32)
    ref = run(oracle_attention_naive, batch, q, case)
    got = run(oracle_fwd, batch, q, case, out=nan_like(q), num_splits=2)
    check_against_naive(case, torch.float32, got, ref, batch)


def test_without_block_scores():
    case = CASES[0]
    batch, q = make_inputs(case, torch.float32)
    kwargs = dict(scale=case.head_dim ** -0.5, sparse_block_size=case.block_size, topk=case.topk)
    args = (q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t)
    out, ids = oracle_attention(*args, **kwargs)
    ref_out, ref_ids = oracle_attention_naive(*args, **kwargs)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    assert (ids == ref_ids).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 math is wrong in the Triton interpreter")
@pytest.mark.parametrize("case", [CASES[0], CASES[3], DECODE], ids=str)
def test_oracle_attention_bf16(case):
    batch, q = make_inputs(case, torch.bfloat16)
    ref_out, ref_ids, ref_scores = run(oracle_attention_naive, batch, q, case)
    out, ids, scores = run(oracle_attention, batch, q, case, out=nan_like(q))
    torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-4)
    assert_same_topk(ids, ref_ids, ref_scores, atol=1e-5)


@pytest.mark.parametrize("case", V_CASES, ids=str)
def test_separate_v_head_dim(case):
    """Naive vs the dense reference ops (output Dv wide, scale by D, selection from q/k only), then every
    Triton kernel layout vs naive."""
    batch, q = make_inputs(case, torch.float32)
    scale = case.head_dim ** -0.5
    ref = run(oracle_attention_naive, batch, q, case)
    assert ref[0].shape == (batch.num_tokens, case.num_heads, case.head_dim_v)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        qr, k, v = q[None, rows], batch.keys[r][None], batch.values[r][None]
        torch.testing.assert_close(ref[0][rows], ops.dense_attention(qr, k, v, scale)[0], atol=1e-5, rtol=1e-5)
        assert (ref[1][rows] == ops.oracle_block_topk(qr, k, scale, case.block_size, case.topk)[0]).all()
    # The split-KV kernel on the mixed batch's 84 prefill rows takes ~24 s in the interpreter: the decode
    # batches cover it.
    decode = all(n == 1 for n in case.q_lens)
    for num_splits in (None, 0, 2) if decode else (None, 0):
        got = run(oracle_fwd, batch, q, case, out=nan_out(batch, q), num_splits=num_splits)
        check_against_naive(case, torch.float32, got, ref, batch)
