# SPDX-License-Identifier: Apache-2.0
"""Top-k helpers of the oracle kernels: a running per-head top-k and the group-max selection.

Why selecting from per-head candidates is exact is derived in this folder's
README. Neither helper sorts: the running top-k replaces its minimum, the
selection takes the best candidate `TOPK` times and then the smallest picked id
`TOPK` times (`tl.sort` is slow under the interpreter and sorts values only).
"""

import triton
import triton.language as tl


@triton.jit
def topk_insert(b_tv, b_ti, b_u, i_b, KP: tl.constexpr):
    """Offer block `i_b` with raw max logits `b_u` `[BM]` to every row's running top-k.

    `b_tv`/`b_ti` `[BM, KP]` hold each row's best raw block maxima and their
    block ids (-1 while empty, value -inf; unused padding slots hold +inf so
    they are never the minimum). Blocks arrive in ascending id order.
    """
    o_k = tl.arange(0, KP)
    b_min = tl.min(b_tv, axis=1)
    # among the slots holding the minimum evict the largest block id, and only a
    # strictly larger value gets in: equal scores keep the smaller ids
    b_key = tl.where(b_tv == b_min[:, None], (b_ti + 1) * KP + o_k[None, :], -1)
    i_slot = tl.max(b_key, axis=1) % KP
    m_hit = (o_k[None, :] == i_slot[:, None]) & (b_u > b_min)[:, None]
    b_tv = tl.where(m_hit, b_u[:, None], b_tv)
    b_ti = tl.where(m_hit, i_b, b_ti)
    return b_tv, b_ti


@triton.jit
def select_topk(b_s, b_id, BQ: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr):
    """The `TOPK` best distinct blocks of each row: `[BQ, KP]` ids ascending, -1 padded.

    `b_s` `[BQ, C]` are candidate scores (>= 0; -1 marks an empty candidate)
    and `b_id` `[BQ, C]` their block ids; a block may appear several times (one
    copy per head or split), and its score is the largest of its copies.
    """
    o_k = tl.arange(0, KP)
    b_sel = tl.full([BQ, KP], -1, tl.int32)
    for i_k in range(TOPK):
        b_best = tl.max(b_s, axis=1)
        # ties go to the smaller block id
        i_pick = tl.min(tl.where(b_s == b_best[:, None], b_id, 2147483647), axis=1)
        i_pick = tl.where(b_best >= 0, i_pick, -1)
        b_sel = tl.where(o_k[None, :] == i_k, i_pick[:, None], b_sel)
        # drop every copy of the picked block
        b_s = tl.where(b_id == i_pick[:, None], -1.0, b_s)
    # ascending order: the picked ids are distinct, so take the smallest remaining TOPK times
    b_left = tl.where(b_sel >= 0, b_sel, 2147483647)
    b_out = tl.full([BQ, KP], -1, tl.int32)
    for i_k in range(TOPK):
        i_min = tl.min(b_left, axis=1)
        b_out = tl.where(o_k[None, :] == i_k, tl.where(i_min == 2147483647, -1, i_min)[:, None], b_out)
        b_left = tl.where(b_left == i_min[:, None], 2147483647, b_left)
    return b_out
