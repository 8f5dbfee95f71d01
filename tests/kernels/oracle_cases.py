# SPDX-License-Identifier: Apache-2.0
"""Oracle cases: inputs (paged batch, strided q `[T, H, D]`), the call, the check of out, `[T, G, k]` ids and scores."""

import torch

from tests.kernel_utils import Case, make_case_inputs

CASES = [
    # prefill (q_len = seq_len), chunked prefill and two decodes; lengths B*k, B*k - 1, B + 1, 2B + 1
    Case([64, 20, 1, 1], [64, 47, 17, 33], pad_tokens=2),
    # MQA; a block spans two pages; NHD physical layout
    Case([40, 1, 9], [40, 95, 63], num_kv_heads=1, block_size=32, topk=2, layout="nhd"),
    # a page holds two blocks; fewer visible blocks than topk (-1 padding); a request with no query rows
    Case([15, 0, 1, 33], [15, 20, 40, 33], page_size=32, topk=4),
    # blocks longer than a key tile; 8 heads per group
    Case([100, 1], [300, 97], num_heads=8, num_kv_heads=1, head_dim=64, block_size=128, topk=2),
    # MHA, the production block size; head dim 128
    Case([30, 1], [70, 129], num_heads=2, num_kv_heads=2, head_dim=128, block_size=64, topk=2),
    # 3 heads per group, head dim and block size not powers of two
    Case([6, 1], [50, 100], num_heads=6, num_kv_heads=2, head_dim=80, block_size=48, topk=2, pad_tokens=1),
]
# decode only: the launcher picks the split-KV kernel
DECODE = Case([1, 1, 1, 1], [1, 16, 65, 200], topk=4, pad_tokens=1)
# k = 16 with more visible blocks than that, in a 1K context
LONG = Case([1, 1, 2], [1100, 300, 1030], num_heads=8, num_kv_heads=2, head_dim=64, block_size=64, topk=16)

# SPEC §2.6: a value head dim of its own, both ways; the decode case takes the split-KV kernel
V_CASES = [
    Case([64, 20, 1, 1], [64, 47, 17, 33], head_dim=48, head_dim_v=32, pad_tokens=2),
    Case([1, 1, 1, 1], [1, 16, 65, 200], num_kv_heads=1, head_dim=32, head_dim_v=64, topk=4, pad_tokens=1),
    Case([1, 1, 1], [9, 47, 130], head_dim=48, head_dim_v=32, pad_tokens=1),
]


def make_inputs(case: Case, dtype, seed=0):
    return make_case_inputs(case, dtype, seed, sinks=False)


def run(fn, batch, q, case, out=None, **kwargs):
    return fn(q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens_t,
              scale=case.head_dim ** -0.5, sparse_block_size=case.block_size, topk=case.topk, out=out,
              return_block_scores=True, **kwargs)


def assert_same_topk(ids, ref_ids, ref_scores, atol):
    """Same selections up to swaps of blocks whose reference scores agree within atol (near ties)."""
    assert ids.shape == ref_ids.shape and ids.dtype == torch.int32
    assert ((ids >= 0).sum(-1) == (ref_ids >= 0).sum(-1)).all(), "different numbers of selected blocks"
    # ascending, distinct, -1 only at the end
    key = ids.long().masked_fill(ids < 0, 1 << 40)
    assert (key[..., 1:] > key[..., :-1]).logical_or(key[..., 1:] == 1 << 40).all(), "ids not ascending"

    def picked(x):
        s = torch.gather(ref_scores, -1, x.long().clamp_min(0)).masked_fill(x < 0, -1.0)
        return s.sort(dim=-1).values

    torch.testing.assert_close(picked(ids), picked(ref_ids), atol=atol, rtol=0)


def check_against_naive(case, dtype, got, ref, batch):
    out, ids, scores = got
    ref_out, ref_ids, ref_scores = ref
    assert not out.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-4)
    assert_same_topk(ids, ref_ids, ref_scores, atol=1e-5)
    # padding rows past the last request: zeros and -1
    n = sum(batch.q_lens)
    assert (out[n:] == 0).all() and (ids[n:] == -1).all()
