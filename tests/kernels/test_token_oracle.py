# SPDX-License-Identifier: Apache-2.0
"""Token oracle attention (HySparse2 cross full layer): naive vs the dense reference ops, Triton vs naive."""

import pytest
import torch

from csrc_triton.token_oracle import token_oracle_attention, token_oracle_attention_naive
from csrc_triton.token_oracle.kernel import token_oracle_fwd
from tests.kernel_utils import DEVICE, nan_like, nan_out
from tests.kernels.token_oracle_cases import (
    CASES,
    LONG,
    V_CASES,
    Case,
    assert_same_selection,
    check_against_naive,
    make_inputs,
    reference_scores,
    run,
)
from vllm_hysparse.reference import ops


@pytest.mark.parametrize("case", CASES + [LONG], ids=str)
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_naive_matches_reference(case, reduce):
    batch, q = make_inputs(case, torch.float32)
    scale = case.head_dim ** -0.5
    out, ids = run(token_oracle_attention_naive, batch, q, case, reduce)
    width = case.topk + case.window
    assert ids.shape == (batch.num_tokens, case.num_kv_heads, width) and ids.dtype == torch.int32
    for r, row0, pos0 in batch.rows():
        n = batch.q_lens[r]
        if n == 0:
            continue
        rows = slice(row0, row0 + n)
        qr, k, v = q[None, rows], batch.keys[r][None], batch.values[r][None]
        torch.testing.assert_close(out[rows], ops.dense_attention(qr, k, v, scale)[0], atol=1e-5, rtol=1e-5)
        ref_ids = ops.token_topk(qr, k, scale, case.topk, case.window, reduce)[0]
        assert (ids[rows] == ref_ids).all()
        # |S_t| = min(t + 1, k + w)
        sizes = torch.tensor([min(pos0 + i + 1, width) for i in range(n)], device=DEVICE)
        assert ((ids[rows] >= 0).sum(-1) == sizes[:, None]).all()
    n = sum(batch.q_lens)
    assert (out[n:] == 0).all() and (ids[n:] == -1).all()


@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("fn", [token_oracle_attention_naive, token_oracle_attention], ids=["naive", "triton"])
def test_ties_go_to_smaller_positions(fn, reduce):
    """q = 0 makes every probability 1 / (t + 1): the first k candidates win, then the window."""
    case = Case([40, 1, 1], [40, 30, 12], topk=5, window=4)
    batch, q = make_inputs(case, torch.float32)
    _, ids = run(fn, batch, torch.zeros_like(q), case, reduce)
    for t, pos in enumerate(batch.positions()):
        start = max(0, pos - case.window + 1)
        want = list(range(min(case.topk, start))) + list(range(start, pos + 1))
        want += [-1] * (case.topk + case.window - len(want))
        assert ids[t].tolist() == [want] * case.num_kv_heads, (t, pos)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_token_oracle_attention(case, dtype, reduce):
    batch, q = make_inputs(case, dtype)
    ref = run(token_oracle_attention_naive, batch, q, case, reduce)
    out = nan_like(q)
    got = run(token_oracle_attention, batch, q, case, reduce, out=out)
    assert got[0] is out
    check_against_naive(case, dtype, reduce, got, ref, batch, q)


@pytest.mark.parametrize("num_splits,block_q", [(None, None), (1, 1), (4, 1), (2, 16)])
def test_long_context(num_splits, block_q):
    """Several key tiles and ~1K candidates: split-KV decode, one split, and the many-rows layout on decode rows."""
    batch, q = make_inputs(LONG, torch.float16, seed=1)
    ref = run(token_oracle_attention_naive, batch, q, LONG, "max")
    got = run(token_oracle_fwd, batch, q, LONG, "max", out=nan_like(q), num_splits=num_splits, block_q=block_q)
    check_against_naive(LONG, torch.float16, "max", got, ref, batch, q)
    # every row has more than k candidates: all k + w slots are used
    assert (got[1][: sum(LONG.q_lens)] >= 0).all()


# a small mixed batch for the launch-layout tests
SMALL = Case([12, 5, 1, 0], [12, 40, 25, 3], topk=6, window=4, pad_tokens=1)


@pytest.mark.parametrize("num_splits,block_q", [(2, None), (1, 1), (2, 4)])
def test_layouts_on_prefill(num_splits, block_q):
    """Split-KV and one-row programs are exact for prefill rows too."""
    case = SMALL
    batch, q = make_inputs(case, torch.float32, seed=2)
    ref = run(token_oracle_attention_naive, batch, q, case, "sum")
    got = run(token_oracle_fwd, batch, q, case, "sum", out=nan_like(q), num_splits=num_splits, block_q=block_q)
    check_against_naive(case, torch.float32, "sum", got, ref, batch, q)


@pytest.mark.parametrize("rows_per_chunk,block_q", [(1, 1), (5, None)])
def test_scratch_chunks(rows_per_chunk, block_q):
    """A small scratch cap processes the rows in chunks; the result is the same as in one go."""
    case = SMALL
    batch, q = make_inputs(case, torch.float16, seed=3)
    full = run(token_oracle_fwd, batch, q, case, "max", block_q=block_q)
    key_width = batch.block_table.shape[1] * case.page_size - case.window
    got = run(token_oracle_fwd, batch, q, case, "max", out=nan_like(q), block_q=block_q,
              scratch_bytes=rows_per_chunk * case.num_kv_heads * key_width * 8)
    assert (got[1] == full[1]).all()
    assert (got[0] == full[0]).all()


@pytest.mark.parametrize("topk,window", [(0, 6), (6, 0), (3, 1)])
@pytest.mark.parametrize("fn", [token_oracle_attention_naive, token_oracle_attention], ids=["naive", "triton"])
def test_budgets(fn, topk, window):
    """Window only, top-k only (the window is empty) and a one-token window."""
    case = Case([12, 1, 1], [12, 5, 60], num_heads=4, num_kv_heads=1, topk=topk, window=window, pad_tokens=1)
    batch, q = make_inputs(case, torch.float32, seed=4)
    scale = case.head_dim ** -0.5
    out, ids = run(fn, batch, q, case, "sum", out=nan_like(q))
    assert ids.shape == (batch.num_tokens, 1, topk + window)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        qr, k, v = q[None, rows], batch.keys[r][None], batch.values[r][None]
        torch.testing.assert_close(out[rows], ops.dense_attention(qr, k, v, scale)[0], atol=1e-4, rtol=1e-4)
        assert (ids[rows] == ops.token_topk(qr, k, scale, topk, window, "sum")[0]).all()
    assert (out[-1] == 0).all() and (ids[-1] == -1).all()


@pytest.mark.parametrize("fn", [token_oracle_attention_naive, token_oracle_attention], ids=["naive", "triton"])
def test_empty_batch_and_bad_reduce(fn):
    case = Case([1], [5])
    batch, q = make_inputs(case, torch.float32)
    out, ids = fn(q[:0], batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc[:1],
                  batch.seq_lens_t[:0], scale=1.0, topk_tokens=2, recent_window=2)
    assert out.shape == (0, case.num_heads, case.head_dim) and ids.shape == (0, case.num_kv_heads, 4)
    with pytest.raises(ValueError, match="score_head_reduce"):
        run(fn, batch, q, case, "mean")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 math is wrong in the Triton interpreter")
@pytest.mark.parametrize("case", [CASES[0], CASES[2], LONG], ids=str)
def test_token_oracle_attention_bf16(case):
    batch, q = make_inputs(case, torch.bfloat16)
    ref_out, ref_ids = run(token_oracle_attention_naive, batch, q, case)
    out, ids = run(token_oracle_attention, batch, q, case, out=nan_like(q))
    torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
    assert_same_selection(ids, ref_ids, reference_scores(batch, q, case, "max"), batch.positions(), case)


def test_scratch_bounded_by_max_seq_len():
    """A host bound on the sequence lengths (vLLM's max_seq_len) narrows the scratch without changing results."""
    case = Case([12, 1, 1], [12, 40, 25], topk=6, window=4)
    batch, q = make_inputs(case, torch.float32, seed=4)
    wide = run(token_oracle_attention, batch, q, case)
    narrow = run(token_oracle_attention, batch, q, case, max_seq_len=max(batch.seq_lens))
    torch.testing.assert_close(narrow[0], wide[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(narrow[1], wide[1])


@pytest.mark.parametrize("case", V_CASES, ids=str)
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_separate_v_head_dim(case, reduce):
    """Naive vs the dense reference ops (output Dv wide, scale by D, selection from q/k only), then the Triton
    kernel's layouts vs naive."""
    batch, q = make_inputs(case, torch.float32)
    scale = case.head_dim ** -0.5
    ref = run(token_oracle_attention_naive, batch, q, case, reduce)
    assert ref[0].shape == (batch.num_tokens, case.num_heads, case.head_dim_v)
    for r, row0, _ in batch.rows():
        rows = slice(row0, row0 + batch.q_lens[r])
        qr, k, v = q[None, rows], batch.keys[r][None], batch.values[r][None]
        torch.testing.assert_close(ref[0][rows], ops.dense_attention(qr, k, v, scale)[0], atol=1e-5, rtol=1e-5)
        assert (ref[1][rows] == ops.token_topk(qr, k, scale, case.topk, case.window, reduce)[0]).all()
    # The decode layout with KV splits on the mixed batch's 40 prefill rows takes ~13 s in the interpreter: the
    # decode batches cover it.
    decode = all(n == 1 for n in case.q_lens)
    for num_splits, block_q in ((None, None), (2, 1), (1, 4)) if decode else ((None, None), (1, 4)):
        got = run(token_oracle_fwd, batch, q, case, reduce, out=nan_out(batch, q), num_splits=num_splits,
                  block_q=block_q)
        check_against_naive(case, torch.float32, reduce, got, ref, batch, q)
