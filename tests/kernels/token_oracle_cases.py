# SPDX-License-Identifier: Apache-2.0
"""Token oracle cases: inputs (paged batch, strided q `[T, H, D]`), the call, the check of out, `[T, G, k+w]` ids."""

import torch

from tests.kernel_utils import DEVICE, TokenCase, make_case_inputs
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

# SPEC §2.6: a value head dim of its own, both ways, in a mixed batch and in decode batches
V_CASES = [
    Case([30, 10, 1, 1, 1], [30, 40, 7, 24, 25], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([1, 1, 1, 1], [1, 8, 25, 200], num_kv_heads=1, head_dim=32, head_dim_v=64, page_size=32, pad_tokens=1),
    Case([1, 1, 1], [9, 40, 130], head_dim=48, head_dim_v=32, pad_tokens=1),
]


def make_inputs(case: Case, dtype, seed=0):
    return make_case_inputs(case, dtype, seed, sinks=False)


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
