# SPDX-License-Identifier: Apache-2.0
"""Token oracle attention (HySparse2 cross full layer): naive vs the dense reference ops, Triton vs naive."""

import pytest
import torch

from csrc_triton.token_oracle import token_oracle_attention, token_oracle_attention_naive
from csrc_triton.token_oracle.kernel import token_oracle_fwd
from tests.kernel_utils import DEVICE, TokenCase, make_paged_batch, nan_like, nan_out
from vllm_hysparse.reference import ops


Case = TokenCase


CASES = [
    # prefill, chunked prefill and decodes; k + w = 24: a prefill past it, decodes shorter than the window,
    # at exactly k + w keys and one past; two padding rows
    Case([30, 10, 1, 1, 1], [30, 40, 7, 24, 25], pad_tokens=2),
    # MQA, small pages, NHD physical layout; a request with no query rows
    Case([9, 0, 1, 3], [9, 5, 100, 33], num_kv_heads=1, head_dim=64, page_size=8, topk=5, window=4, layout="nhd"),
    # decode only: the launcher's split-KV layout
    Case([1, 1, 1, 1], [1, 8, 25, 200], page_size=32, pad_tokens=1),
    # 3 heads per group, head dim not a power of two
    Case([6, 1], [50, 100], num_heads=6, num_kv_heads=2, head_dim=80, topk=5, window=4, pad_tokens=1),
    # MHA, head dim 128, a window longer than the top-k
    Case([20, 1], [40, 129], num_heads=2, num_kv_heads=2, head_dim=128, topk=4, window=12),
]
# decode rows over several key tiles, 16 picked out of ~1K candidates
LONG = Case([1, 1, 2], [1100, 300, 700], num_heads=8, num_kv_heads=2, head_dim=64, topk=16, window=8)


def make_inputs(case: Case, dtype, seed=0):
    batch = make_paged_batch(case.q_lens, case.seq_lens, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                             page_size=case.page_size, dtype=dtype, seed=seed, layout=case.layout,
                             pad_tokens=case.pad_tokens, head_dim_v=case.head_dim_v)
    g = torch.Generator().manual_seed(seed + 1)
    # a strided q: every other head of a wider projection output
    q = torch.randn(batch.num_tokens, 2 * case.num_heads, case.head_dim, generator=g).to(dtype)[:, ::2]
    return batch, q.to(DEVICE)


def run(fn, batch, q, case, reduce="max", out=None, **kwargs):
    return fn(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t,
              scale=case.head_dim ** -0.5, topk_tokens=case.topk, recent_window=case.window,
              score_head_reduce=reduce, out=out, **kwargs)


def reference_scores(batch, q, case, reduce):
    """`[T, G, max seq_len]` float32 R of the dense reference (0 past each row's keys and on padding rows)."""
    scale = case.head_dim ** -0.5
    r_all = torch.zeros(batch.num_tokens, case.num_kv_heads, max(batch.seq_lens), device=DEVICE)
    for r, row0, _ in batch.rows():
        n = batch.q_lens[r]
        if n == 0:
            continue
        z = ops.attention_logits(q[None, row0: row0 + n], batch.keys[r][None], scale)
        rs = ops.reduce_heads(ops.sink_softmax(z, None), case.num_kv_heads, reduce)[0]  # [G, n, S]
        r_all[row0: row0 + n, :, : rs.shape[-1]] = rs.transpose(0, 1)
    return r_all


def assert_same_selection(ids, ref_ids, ref_scores, positions, case, atol=1e-5, margin=1e-4):
    """Same S_t up to swaps of positions whose reference scores agree within atol (near ties).

    Rows whose k-th and (k+1)-th best candidates are more than `margin` apart must match exactly.
    """
    assert ids.shape == ref_ids.shape and ids.dtype == torch.int32
    valid = ids >= 0
    assert (valid.sum(-1) == (ref_ids >= 0).sum(-1)).all(), "different numbers of selected positions"
    # ascending, distinct, -1 only at the end
    key = ids.long().masked_fill(~valid, 1 << 40)
    assert ((key[..., 1:] > key[..., :-1]) | (key[..., 1:] == 1 << 40)).all(), "ids not ascending"
    pos = torch.tensor(positions, device=ids.device)[:, None, None]
    assert ((ids <= pos) | ~valid).all(), "a position after its query"
    # the window is forced: rank it above every probability
    j = torch.arange(ref_scores.shape[-1], device=ids.device)
    in_window = (j > pos - case.window) & (j <= pos)
    keyed = ref_scores.masked_fill(in_window, 1e9)

    def picked(x):
        s = torch.gather(keyed, -1, x.long().clamp_min(0)).masked_fill(x < 0, -1.0)
        return s.sort(dim=-1).values

    torch.testing.assert_close(picked(ids), picked(ref_ids), atol=atol, rtol=0)
    # exact where there is no near tie at the top-k boundary
    cand = keyed.masked_fill((j > pos - case.window) | (pos < 0), -1.0).sort(dim=-1, descending=True).values
    if 0 < case.topk < cand.shape[-1]:
        gap = cand[..., case.topk - 1] - cand[..., case.topk]
        clear = (gap > margin) | (cand[..., case.topk] < 0)
    else:
        clear = torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
    assert (ids == ref_ids).all(-1)[clear].all(), "different selections without a near tie"


def check_against_naive(case, dtype, reduce, got, ref, batch, q):
    out, ids = got
    ref_out, ref_ids = ref
    assert not out.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    assert_same_selection(ids, ref_ids, reference_scores(batch, q, case, reduce), batch.positions(), case)
    # padding rows past the last request: zeros and -1
    n = sum(batch.q_lens)
    assert (out[n:] == 0).all() and (ids[n:] == -1).all()


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


# SPEC §2.6: a value head dim of its own, both ways, in a mixed batch and in decode batches
V_CASES = [
    Case([30, 10, 1, 1, 1], [30, 40, 7, 24, 25], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([1, 1, 1, 1], [1, 8, 25, 200], num_kv_heads=1, head_dim=32, head_dim_v=64, page_size=32, pad_tokens=1),
    Case([1, 1, 1], [9, 40, 130], head_dim=48, head_dim_v=32, pad_tokens=1),
]


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
