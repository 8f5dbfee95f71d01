# SPDX-License-Identifier: Apache-2.0
"""The key-tile step shared by the oracle's prefill and split-KV decode kernels.

One step attends the rows of a program (query heads of one KV group, one or
more query tokens) to `BLOCK_N` keys gathered through the block table, updates
the online softmax (base-2 logits), and feeds each sparse block's raw max logit
to the rows' running top-k (`topk.topk_insert`).
"""

import torch
import triton
import triton.language as tl

from csrc_triton.oracle.topk import topk_insert


def dot_in_fp32(q: torch.Tensor) -> bool:
    """fp32 inputs dot in fp32 (ieee); so does bf16 under the interpreter, which multiplies bf16 bit patterns."""
    return q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu")


def key_tile(sparse_block_size: int, max_tile: int) -> int:
    """Keys per tile: `max_tile`, or for a block size that is no power of two its largest power-of-two
    divisor, so that every sparse block is a whole number of tiles."""
    if sparse_block_size & (sparse_block_size - 1) == 0:
        return max_tile
    return min(max_tile, sparse_block_size & -sparse_block_size)


@triton.jit
def find_request(query_start_loc, num_reqs, i_target, BLOCK_Q: tl.constexpr, BY_BLOCK: tl.constexpr):
    """The request that owns row `i_target` (BY_BLOCK: q-block `i_target`).

    Request r's q-blocks are numbered from `query_start_loc[r] // BLOCK_Q + r`,
    an upper bound that needs no host sync. Returns the last r whose first
    row (q-block) is <= i_target.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid)
        if BY_BLOCK:
            first = first // BLOCK_Q + mid
        if first <= i_target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_tile(
    b_q, b_acc, b_m, b_l, b_tv, b_ti, b_run,
    i_n, n_tiles, kv_len, o_pos, m_row,
    p_bt, p_k, p_v, p_u,
    stride_k_p, stride_k_s, stride_k_d,
    stride_v_p, stride_v_s, stride_v_d,
    num_score_blocks,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KP: tl.constexpr,
    STORE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Key tile `i_n` (of `n_tiles`, keys `< kv_len` readable) for rows at positions `o_pos` `[BM]`.

    `b_run` `[BM]` carries a sparse block's max across tiles when the block is
    longer than a tile. `p_u` `[BM]` points at each row's raw block maxima (written only when
    STORE_SCORES, for rows in `m_row`). Keys are HEAD_DIM wide, values and
    `b_acc` HEAD_DIM_V wide (SPEC §2.6).
    """
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < kv_len
    m_d = o_d < HEAD_DIM
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < HEAD_DIM_V
    # [BLOCK_N] physical page and slot of every key; int64 before any stride multiply
    i_pg = tl.load(p_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
    o_slot = (o_n % PAGE_SIZE).to(tl.int64)
    # [BLOCK_D, BLOCK_N]
    b_kt = tl.load(p_k + i_pg[None, :] * stride_k_p + o_slot[None, :] * stride_k_s + o_d[:, None] * stride_k_d,
                   mask=m_d[:, None] & m_n[None, :], other=0.0)
    # [BM, BLOCK_N] base-2 logits, -inf past the causal limit of each row
    if DOT_FP32:
        b_s = tl.dot(b_q, b_kt.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        b_s = tl.dot(b_q, b_kt.to(b_q.dtype)) * qk_scale
    b_s = tl.where((o_n[None, :] <= o_pos[:, None]) & m_n[None, :], b_s, float("-inf"))

    if SPARSE_BLOCK >= BLOCK_N:
        b_u = tl.max(b_s, axis=1)
        b_mt = tl.maximum(b_m, b_u)
        i_b = (i_n * BLOCK_N) // SPARSE_BLOCK
        if SPARSE_BLOCK > BLOCK_N:
            # the block ends with this tile or with the keys
            b_run = tl.maximum(b_run, b_u)
            is_end = ((i_n + 1) % (SPARSE_BLOCK // BLOCK_N) == 0) | (i_n + 1 == n_tiles)
            b_u = tl.where(is_end, b_run, float("-inf"))
            b_run = tl.where(is_end, float("-inf"), b_run)
        # a block with no visible key keeps -inf and never enters
        b_tv, b_ti = topk_insert(b_tv, b_ti, b_u, i_b, KP=KP)
        if STORE_SCORES:
            # i_b < cdiv(seq_len, SPARSE_BLOCK) <= num_score_blocks
            tl.store(p_u + i_b, b_u, mask=m_row & (b_u > float("-inf")))
    else:
        BPT: tl.constexpr = BLOCK_N // SPARSE_BLOCK
        o_j = tl.arange(0, BPT)
        # [BM, BPT] max of each sparse block in the tile
        b_u2 = tl.max(tl.reshape(b_s, (b_s.shape[0], BPT, SPARSE_BLOCK)), axis=2)
        b_mt = tl.maximum(b_m, tl.max(b_u2, axis=1))
        for j in tl.static_range(BPT):
            b_u = tl.max(tl.where(o_j[None, :] == j, b_u2, float("-inf")), axis=1)
            b_tv, b_ti = topk_insert(b_tv, b_ti, b_u, i_n * BPT + j, KP=KP)
        if STORE_SCORES:
            i_b = i_n * BPT + o_j
            tl.store(p_u[:, None] + i_b[None, :], b_u2,
                     mask=m_row[:, None] & (b_u2 > float("-inf")) & (i_b < num_score_blocks)[None, :])

    # online softmax; a row with no key yet keeps m = -inf and shifts by 0 so exp2 gives 0, not NaN
    b_shift = tl.where(b_mt == float("-inf"), 0.0, b_mt)
    b_p = tl.exp2(b_s - b_shift[:, None])
    b_alpha = tl.exp2(b_m - b_shift)
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    # [BLOCK_N, BLOCK_DV]; masked so NaN in unwritten slots never reaches 0 * NaN
    b_v = tl.load(p_v + i_pg[:, None] * stride_v_p + o_slot[:, None] * stride_v_s + o_dv[None, :] * stride_v_d,
                  mask=m_n[:, None] & m_dv[None, :], other=0.0)
    if DOT_FP32:
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
    else:
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype))
    return b_acc, b_mt, b_l, b_tv, b_ti, b_run
