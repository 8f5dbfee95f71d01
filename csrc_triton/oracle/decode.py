# SPDX-License-Identifier: Apache-2.0
"""Split-KV oracle attention for decode batches (few query tokens, long contexts).

Stage 1: one program per (query token, KV group, split); its rows are the
group's query heads and it walks one contiguous range of the token's key
tiles, aligned to sparse blocks, keeping the online-softmax partials and a
running top-k of raw block maxima. Stage 2: one program per (token, group)
merges the partials by log-sum-exp and selects the group top-k from the
candidates of every split and head; the union argument of README.md holds
across splits because no block straddles two. The kernels handle any batch
(each token finds its own request); `kernel.oracle_fwd` sends decode batches here.
"""

import torch
import triton
import triton.language as tl

from csrc_triton.oracle.tile import attend_tile, dot_in_fp32, find_request, key_tile
from csrc_triton.oracle.topk import select_topk

LOG2E = 1.4426950408889634


@triton.jit
def oracle_decode_kernel(
    q,  # [T, H, D]
    k_cache,  # [num_pages, G, page_size, D]
    v_cache,  # [num_pages, G, page_size, Dv]
    part_o,  # [T, G, NUM_SPLITS, BLOCK_H, BLOCK_DV] float32, unnormalised
    part_m,  # [T, G, NUM_SPLITS, BLOCK_H] float32 base-2 running max
    part_l,  # [T, G, NUM_SPLITS, BLOCK_H] float32 softmax denominator
    part_tv,  # [T, G, NUM_SPLITS, BLOCK_H, KP] float32 raw block maxima of the running top-k
    part_ti,  # [T, G, NUM_SPLITS, BLOCK_H, KP] int32 their block ids, -1 when empty
    block_u,  # [T, H, NB] float32, written when STORE_SCORES
    block_table,  # [R, max_pages] int32
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    qk_scale,
    num_reqs,
    num_score_blocks,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_g, stride_k_s, stride_k_d,
    stride_v_p, stride_v_g, stride_v_s, stride_v_d,
    stride_bt_r,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    STORE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    i_r = find_request(query_start_loc, num_reqs, i_t, BLOCK_Q=1, BY_BLOCK=False)
    eos = tl.load(query_start_loc + i_r + 1)
    if i_t >= eos:
        # a padding row past the last request: stage 2 writes it
        return
    seq_len = tl.load(seq_lens + i_r)
    pos = seq_len - (eos - i_t)

    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_k = tl.arange(0, KP)
    m_row = o_m < HEADS_PER_GROUP
    m_d = o_d < HEAD_DIM
    i_h = i_g * HEADS_PER_GROUP + o_m
    o_pos = tl.where(m_row, pos, -1)
    i_t64 = i_t.to(tl.int64)
    # [BLOCK_M, BLOCK_D]
    b_q = tl.load(q + i_t64 * stride_q_t + i_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d,
                  mask=m_row[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # [BLOCK_M, KP] running top-k; slots >= TOPK hold +inf and are never replaced
    b_tv = tl.where(o_k[None, :] < TOPK, float("-inf"), float("inf")) + tl.zeros([BLOCK_M, KP], tl.float32)
    b_ti = tl.full([BLOCK_M, KP], -1, tl.int32)

    # this split's key tiles, a whole number of sparse blocks
    n_tiles = tl.cdiv(pos + 1, BLOCK_N)
    per_split = tl.cdiv(tl.cdiv(n_tiles, NUM_SPLITS), TILES_PER_BLOCK) * TILES_PER_BLOCK
    i_start = i_s * per_split
    i_end = tl.minimum(i_start + per_split, n_tiles)
    p_bt = block_table + i_r.to(tl.int64) * stride_bt_r
    p_k = k_cache + i_g * stride_k_g
    p_v = v_cache + i_g * stride_v_g
    p_u = block_u + (i_t64 * (num_kv_heads * HEADS_PER_GROUP) + i_h) * num_score_blocks
    for i_n in range(i_start, i_end):
        b_acc, b_m, b_l, b_tv, b_ti, b_run = attend_tile(
            b_q, b_acc, b_m, b_l, b_tv, b_ti, b_run,
            i_n, n_tiles, pos + 1, o_pos, m_row,
            p_bt, p_k, p_v, p_u,
            stride_k_p, stride_k_s, stride_k_d,
            stride_v_p, stride_v_s, stride_v_d,
            num_score_blocks,
            qk_scale,
            HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V,
            PAGE_SIZE=PAGE_SIZE,
            SPARSE_BLOCK=SPARSE_BLOCK,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            BLOCK_DV=BLOCK_DV,
            KP=KP,
            STORE_SCORES=STORE_SCORES,
            DOT_FP32=DOT_FP32,
        )

    # rows >= BLOCK_H are padding for tl.dot and are not stored
    m_keep = o_m < BLOCK_H
    i_part = ((i_t64 * num_kv_heads + i_g) * NUM_SPLITS + i_s) * BLOCK_H + o_m
    tl.store(part_o + i_part[:, None] * BLOCK_DV + o_dv[None, :], b_acc, mask=m_keep[:, None])
    tl.store(part_m + i_part, b_m, mask=m_keep)
    tl.store(part_l + i_part, b_l, mask=m_keep)
    tl.store(part_tv + i_part[:, None] * KP + o_k[None, :], b_tv, mask=m_keep[:, None])
    tl.store(part_ti + i_part[:, None] * KP + o_k[None, :], b_ti, mask=m_keep[:, None])


@triton.jit
def oracle_decode_reduce_kernel(
    part_o, part_m, part_l, part_tv, part_ti,  # stage-1 partials, see oracle_decode_kernel
    out,  # [T, H, Dv]
    indices,  # [T, G, TOPK] int32
    block_lse,  # [T, H] float32, written when STORE_SCORES
    query_start_loc,  # [R + 1] int32
    num_reqs,
    stride_o_t, stride_o_h, stride_o_d,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    STORE_SCORES: tl.constexpr,
):
    """Merges the partials; only values reach it, so its head dim is the value head dim."""
    i_t = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1).to(tl.int64)
    num_kv_heads = tl.num_programs(1)
    o_s = tl.arange(0, NUM_SPLITS)
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_DV)
    o_k = tl.arange(0, KP)
    m_h = o_h < HEADS_PER_GROUP
    i_h = i_g * HEADS_PER_GROUP + o_h
    p_o = out + i_t * stride_o_t + i_h[:, None] * stride_o_h + o_d[None, :] * stride_o_d
    m_o = m_h[:, None] & (o_d < HEAD_DIM_V)[None, :]
    p_i = indices + (i_t * num_kv_heads + i_g) * TOPK + o_k[None, :]
    if i_t >= tl.load(query_start_loc + num_reqs):
        # a padding row past the last request has no partials: zeros and -1
        tl.store(p_o, tl.zeros([BLOCK_H, BLOCK_DV], tl.float32).to(out.dtype.element_ty), mask=m_o)
        tl.store(p_i, tl.full([1, KP], -1, tl.int32), mask=(o_k < TOPK)[None, :])
        return
    # [NUM_SPLITS, BLOCK_H]
    i_part = ((i_t * num_kv_heads + i_g) * NUM_SPLITS + o_s[:, None]) * BLOCK_H + o_h[None, :]
    b_m = tl.load(part_m + i_part)
    b_l = tl.load(part_l + i_part)
    b_mx = tl.max(b_m, axis=0)
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    # [NUM_SPLITS, BLOCK_H] weight of each split; empty splits have m = -inf and weigh 0
    b_w = tl.exp2(b_m - b_mx[None, :])
    b_lsum = tl.sum(b_w * b_l, axis=0)
    b_lsum = tl.where(b_lsum > 0, b_lsum, 1.0)
    # [NUM_SPLITS, BLOCK_H, BLOCK_DV]
    b_acc = tl.load(part_o + i_part[:, :, None] * BLOCK_DV + o_d[None, None, :])
    b_o = tl.sum(b_w[:, :, None] * b_acc, axis=0) / b_lsum[:, None]
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
    b_lse = b_mx + tl.log2(b_lsum)
    if STORE_SCORES:
        tl.store(block_lse + i_t * (num_kv_heads * HEADS_PER_GROUP) + i_h, b_lse, mask=m_h)

    # [NUM_SPLITS, BLOCK_H, KP] candidates of every split and head, normalised by the head's lse
    b_tv = tl.load(part_tv + i_part[:, :, None] * KP + o_k[None, None, :])
    b_ti = tl.load(part_ti + i_part[:, :, None] * KP + o_k[None, None, :])
    m_c = (b_ti >= 0) & m_h[None, :, None] & (o_k < TOPK)[None, None, :]
    b_c = tl.where(m_c, tl.exp2(b_tv - b_lse[None, :, None]), -1.0)
    b_c = tl.reshape(b_c, (1, NUM_SPLITS * BLOCK_H * KP))
    b_ci = tl.reshape(b_ti, (1, NUM_SPLITS * BLOCK_H * KP))
    b_sel = select_topk(b_c, b_ci, BQ=1, TOPK=TOPK, KP=KP)
    tl.store(p_i, b_sel, mask=(o_k < TOPK)[None, :])


def reduce_num_warps(num_splits, block_h, block_d):
    """Warps of `oracle_decode_reduce_kernel`: at most 32 of its `[NUM_SPLITS, BLOCK_H, BLOCK_D]` fp32
    partials per thread, 4 to 16 warps.

    The merge holds every partial at once and only streams them, so more warps cost nothing; with 4
    warps, 16 splits x 16 heads spill from head dim 128 up (sm_90 AOT builds, tests/kernels_aot).
    """
    return min(16, max(4, num_splits * block_h * block_d // (32 * 32)))


def oracle_decode_fwd(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, indices, block_u, block_lse,
                      *, scale, sparse_block_size, topk, store_scores, num_splits):
    """Launches both split-KV stages on checked inputs and allocated outputs (`kernel.oracle_fwd`)."""
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, \
        f"num_splits must be a power of two (got {num_splits})"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    heads_per_group = num_heads // num_kv_heads
    block_h = triton.next_power_of_2(heads_per_group)
    head_dim_v = v_cache.shape[3]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    kp = triton.next_power_of_2(topk)
    dot_fp32 = dot_in_fp32(q)
    block_n = key_tile(sparse_block_size, 32 if (max(block_d, block_dv) > 128 or dot_fp32) else 64)
    part = (num_tokens, num_kv_heads, num_splits, block_h)
    part_o = torch.empty(*part, block_dv, dtype=torch.float32, device=q.device)
    part_m = torch.empty(part, dtype=torch.float32, device=q.device)
    part_l = torch.empty(part, dtype=torch.float32, device=q.device)
    part_tv = torch.empty(*part, kp, dtype=torch.float32, device=q.device)
    part_ti = torch.empty(*part, kp, dtype=torch.int32, device=q.device)
    oracle_decode_kernel[(num_tokens, num_kv_heads, num_splits)](
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        part_o=part_o,
        part_m=part_m,
        part_l=part_l,
        part_tv=part_tv,
        part_ti=part_ti,
        block_u=block_u,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        qk_scale=float(scale) * LOG2E,
        num_reqs=seq_lens.shape[0],
        num_score_blocks=block_u.shape[-1] if store_scores else 0,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_p=k_cache.stride(0), stride_k_g=k_cache.stride(1),
        stride_k_s=k_cache.stride(2), stride_k_d=k_cache.stride(3),
        stride_v_p=v_cache.stride(0), stride_v_g=v_cache.stride(1),
        stride_v_s=v_cache.stride(2), stride_v_d=v_cache.stride(3),
        stride_bt_r=block_table.stride(0),
        HEADS_PER_GROUP=heads_per_group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        PAGE_SIZE=k_cache.shape[2],
        SPARSE_BLOCK=sparse_block_size,
        TOPK=topk,
        KP=kp,
        TILES_PER_BLOCK=max(1, sparse_block_size // block_n),
        NUM_SPLITS=num_splits,
        # tl.dot needs at least 16 rows on GPUs; padded head rows are masked
        BLOCK_M=max(16, block_h),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        STORE_SCORES=store_scores,
        DOT_FP32=dot_fp32,
        # q/k 192 (tiled as 256) with v 128 spills 4 B at 4 warps with one split (sm_90 AOT builds)
        num_warps=8 if block_d != block_dv and max(block_d, block_dv) > 128 else 4,
    )
    oracle_decode_reduce_kernel[(num_tokens, num_kv_heads)](
        part_o=part_o,
        part_m=part_m,
        part_l=part_l,
        part_tv=part_tv,
        part_ti=part_ti,
        out=out,
        indices=indices,
        block_lse=block_lse,
        query_start_loc=query_start_loc,
        num_reqs=seq_lens.shape[0],
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        HEADS_PER_GROUP=heads_per_group,
        HEAD_DIM_V=head_dim_v,
        TOPK=topk,
        KP=kp,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_h,
        BLOCK_DV=block_dv,
        STORE_SCORES=store_scores,
        num_warps=reduce_num_warps(num_splits, block_h, block_dv),
    )
