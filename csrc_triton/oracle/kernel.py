# SPDX-License-Identifier: Apache-2.0
"""Triton oracle attention: causal paged attention plus the oracle's top-k blocks (SPEC §3.1).

Prefill kernel: one program per (q-block, KV group); its rows are BLOCK_Q
query tokens x the group's query heads (vLLM's GQA packing), so each K/V tile
is gathered once for the whole group. The tile loop (`tile.attend_tile`) keeps
each row's online softmax and a running top-k of raw block maxima; the
epilogue normalises the candidates with the row's final log-sum-exp, takes the
group max and selects the top-k (README.md: why this is exact). Decode batches
go to the split-KV kernels of `decode.py`.
"""

import torch
import triton
import triton.language as tl

from csrc_triton.oracle.decode import oracle_decode_fwd
from csrc_triton.oracle.tile import attend_tile, dot_in_fp32, find_request, key_tile
from csrc_triton.oracle.topk import select_topk
from csrc_triton.paged_args import FP8_KV_DTYPE, check_paged_batch, kv_scaled

LOG2E = 1.4426950408889634
# vLLM's rule for its split-KV decode: use it while requests x KV groups leave the GPU under-filled
SPLIT_KV_MAX_PROGRAMS = 128
MAX_SPLITS = 16


@triton.jit
def oracle_fwd_kernel(
    q,  # [T, H, D]
    k_cache,  # [num_pages, G, page_size, D]
    v_cache,  # [num_pages, G, page_size, Dv]
    out,  # [T, H, Dv]
    indices,  # [T, G, TOPK] int32
    block_u,  # [T, H, NB] float32 raw base-2 block maxima, written when STORE_SCORES
    block_lse,  # [T, H] float32 base-2 log-sum-exp, written when STORE_SCORES
    block_table,  # [R, max_pages] int32
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    qk_scale,  # scale * log2(e)
    num_tokens,
    num_reqs,
    num_score_blocks,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_g, stride_k_s, stride_k_d,
    stride_v_p, stride_v_g, stride_v_s, stride_v_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_bt_r,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    STORE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    i_qb = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    num_kv_heads = tl.num_programs(1)
    i_r = find_request(query_start_loc, num_reqs, i_qb, BLOCK_Q=BLOCK_Q, BY_BLOCK=True)
    bos = tl.load(query_start_loc + i_r)
    eos = tl.load(query_start_loc + i_r + 1)
    seq_len = tl.load(seq_lens + i_r)
    q_len = eos - bos
    # q-block of the request; past its last one a program only zeroes padding rows
    i_qs = i_qb - (bos // BLOCK_Q + i_r)
    num_real = tl.load(query_start_loc + num_reqs)

    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_k = tl.arange(0, KP)
    # row m is query m // BLOCK_H of the q-block, head m % BLOCK_H of the group
    o_q = i_qs * BLOCK_Q + o_m // BLOCK_H
    o_t = (bos + o_q).to(tl.int64)
    m_h = (o_m % BLOCK_H) < HEADS_PER_GROUP
    i_h = i_g * HEADS_PER_GROUP + (o_m % BLOCK_H)
    m_row = (o_q < q_len) & m_h
    # rows past the last request (padding tokens) are written too: zeros and -1
    m_pad = (o_t >= num_real) & (o_t < num_tokens)
    o_pos = tl.where(m_row, seq_len - q_len + o_q, -1)
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

    # [BLOCK_M, BLOCK_D]
    b_q = tl.load(q + o_t[:, None] * stride_q_t + i_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d,
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

    # keys up to the last query of the block
    kv_len = seq_len - q_len + tl.minimum((i_qs + 1) * BLOCK_Q, q_len)
    n_tiles = tl.where(i_qs * BLOCK_Q < q_len, tl.cdiv(kv_len, BLOCK_N), 0)
    p_bt = block_table + i_r.to(tl.int64) * stride_bt_r
    p_k = k_cache + i_g * stride_k_g
    p_v = v_cache + i_g * stride_v_g
    p_u = block_u + (o_t * (num_kv_heads * HEADS_PER_GROUP) + i_h) * num_score_blocks
    for i_n in range(0, n_tiles):
        b_acc, b_m, b_l, b_tv, b_ti, b_run = attend_tile(
            b_q, b_acc, b_m, b_l, b_tv, b_ti, b_run,
            i_n, n_tiles, kv_len, o_pos, m_row,
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

    b_l = tl.where(b_l > 0, b_l, 1.0)
    b_o = b_acc / b_l[:, None]
    tl.store(out + o_t[:, None] * stride_o_t + i_h[:, None] * stride_o_h + o_dv[None, :] * stride_o_d,
             b_o.to(out.dtype.element_ty), mask=(m_row | (m_pad & m_h))[:, None] & m_dv[None, :])
    b_lse = tl.where(m_row, b_m + tl.log2(b_l), 0.0)
    if STORE_SCORES:
        tl.store(block_lse + o_t * (num_kv_heads * HEADS_PER_GROUP) + i_h, b_lse, mask=m_row)

    # S = exp(u - lse) of every candidate; -1 marks an empty one
    m_c = m_row[:, None] & (b_ti >= 0) & (o_k < TOPK)[None, :]
    b_c = tl.where(m_c, tl.exp2(b_tv - b_lse[:, None]), -1.0)
    # [BLOCK_Q, BLOCK_H * KP]: the candidates of all heads of a query side by side
    b_c = tl.reshape(b_c, (BLOCK_Q, BLOCK_H * KP))
    b_ci = tl.reshape(b_ti, (BLOCK_Q, BLOCK_H * KP))
    b_sel = select_topk(b_c, b_ci, BQ=BLOCK_Q, TOPK=TOPK, KP=KP)
    o_qq = i_qs * BLOCK_Q + tl.arange(0, BLOCK_Q)
    o_tq = (bos + o_qq).to(tl.int64)
    m_q = (o_qq < q_len) | ((o_tq >= num_real) & (o_tq < num_tokens))
    p_i = indices + (o_tq[:, None] * num_kv_heads + i_g) * TOPK + o_k[None, :]
    tl.store(p_i, b_sel, mask=m_q[:, None] & (o_k < TOPK)[None, :])


def check_args(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, sparse_block_size, topk, out):
    """The shared paged-batch checks plus the oracle's own; returns `out`, allocated when None."""
    assert sparse_block_size > 0 and sparse_block_size % 16 == 0, \
        f"sparse_block_size must be a positive multiple of 16 (got {sparse_block_size})"
    assert topk >= 1, f"topk must be positive (got {topk})"
    return check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)[0]


def default_num_splits(num_tokens, num_reqs, num_kv_heads, max_keys, block_n):
    """0 (prefill kernel) unless every request decodes one token; then the KV splits per token.

    Decided from shapes only (no host sync): `num_tokens == num_reqs` and
    `max_keys` is the block table's capacity. Both kernels are exact for any batch.
    """
    if num_tokens != num_reqs:
        return 0
    if num_reqs * num_kv_heads > SPLIT_KV_MAX_PROGRAMS:
        return 1
    # at least 4 key tiles per split
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, max_keys // (4 * block_n))))


def oracle_prefill_fwd(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, indices, block_u, block_lse,
                       *, scale, sparse_block_size, topk, store_scores):
    """Launches the prefill kernel on checked inputs and allocated outputs."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    heads_per_group = num_heads // num_kv_heads
    block_h = triton.next_power_of_2(heads_per_group)
    head_dim_v = v_cache.shape[3]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    widest = max(block_d, block_dv)  # 192 / 128 tiles as 256 / 128: the wider one sets the config
    dot_fp32 = dot_in_fp32(q)
    # one config per head dim: 128 rows up to D = 128, 64 rows for D = 256 (registers and shared memory)
    block_m = 128 if widest <= 128 else 64
    # 4 warps spill at 128 rows x D = 64 (sm_90 AOT check); tiny tiles of test head dims need no more than 4
    num_warps = 8 if block_m * widest >= 128 * 64 else 4
    if widest > 128 and k_cache.dtype == FP8_KV_DTYPE:
        # e4m3 tiles (sm_90 AOT check): 64 rows spill at 3 heads per group; 32 rows build clean with 8 warps
        # at Dv = 256 and with 4 at Dv = 128 (8 warps spill there)
        block_m, num_warps = 32, 8 if block_dv > 128 else 4
    block_n = key_tile(sparse_block_size, 32 if (widest > 128 or dot_fp32) else 64)
    block_q = max(1, block_m // block_h)
    grid = (num_tokens // block_q + seq_lens.shape[0], num_kv_heads)
    oracle_fwd_kernel[grid](
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        out=out,
        indices=indices,
        block_u=block_u,
        block_lse=block_lse,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        qk_scale=float(scale) * LOG2E,
        num_tokens=num_tokens,
        num_reqs=seq_lens.shape[0],
        num_score_blocks=block_u.shape[-1] if store_scores else 0,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_p=k_cache.stride(0), stride_k_g=k_cache.stride(1),
        stride_k_s=k_cache.stride(2), stride_k_d=k_cache.stride(3),
        stride_v_p=v_cache.stride(0), stride_v_g=v_cache.stride(1),
        stride_v_s=v_cache.stride(2), stride_v_d=v_cache.stride(3),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_bt_r=block_table.stride(0),
        HEADS_PER_GROUP=heads_per_group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        PAGE_SIZE=k_cache.shape[2],
        SPARSE_BLOCK=sparse_block_size,
        TOPK=topk,
        KP=triton.next_power_of_2(topk),
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        STORE_SCORES=store_scores,
        DOT_FP32=dot_fp32,
        num_warps=num_warps,
    )


def oracle_fwd(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, sparse_block_size, topk,
               out=None, return_block_scores=False, num_splits=None):
    """`oracle_attention` with the kernel choice exposed.

    Args:
        num_splits (int, Optional): 0 runs the prefill kernel; n >= 1 (a power of two)
            the split-KV kernel with n KV splits per token. Default: `None` (chosen from shapes).
    """
    out = check_args(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, sparse_block_size, topk, out)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    num_reqs = seq_lens.shape[0]
    indices = torch.empty((num_tokens, num_kv_heads, topk), dtype=torch.int32, device=q.device)
    if return_block_scores:
        num_blocks = triton.cdiv(int(seq_lens.max()), sparse_block_size) if num_reqs > 0 else 0
        block_u = torch.full((num_tokens, num_heads, num_blocks), float("-inf"), dtype=torch.float32, device=q.device)
        block_lse = torch.zeros((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        # never dereferenced: STORE_SCORES is off and num_score_blocks is 0
        block_u = block_lse = torch.empty(1, dtype=torch.float32, device=q.device)
    if num_reqs == 0 or num_tokens == 0:
        out.zero_()
        indices.fill_(-1)
    else:
        if num_splits is None:
            max_keys = block_table.shape[1] * k_cache.shape[2]
            num_splits = default_num_splits(num_tokens, num_reqs, num_kv_heads, max_keys, 64)
        launch = oracle_prefill_fwd if num_splits == 0 else oracle_decode_fwd
        extra = {} if num_splits == 0 else {"num_splits": num_splits}
        launch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, indices, block_u, block_lse,
               scale=scale, sparse_block_size=sparse_block_size, topk=topk, store_scores=return_block_scores,
               **extra)
    if not return_block_scores:
        return out, indices
    # R = max over the group's heads of exp(u - lse); blocks never written stay -inf -> 0
    scores = torch.exp2(block_u - block_lse[..., None])
    scores = scores.view(num_tokens, num_kv_heads, num_heads // num_kv_heads, num_blocks).amax(dim=2)
    return out, indices, scores


@kv_scaled
def oracle_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, sparse_block_size, topk,
                     out=None, return_block_scores=False):
    """Causal paged attention of a HySparse full layer and its oracle block indices (SPEC §3.1).

    Args:
        q (torch.Tensor): `[T, H, D]`, any strides; fp16, bf16 or fp32.
        k_cache (torch.Tensor): `[num_pages, G, page_size, D]`, any strides, q's dtype or float8_e4m3fn.
        v_cache (torch.Tensor): `[num_pages, G, page_size, Dv]`, any strides, k_cache's dtype (Dv may differ from D).
        block_table (torch.Tensor): `[R, max_pages]` int32; position p of request r is in page
            `block_table[r, p // page_size]`, slot `p % page_size`.
        query_start_loc (torch.Tensor): `[R + 1]` int32; request r owns rows
            `query_start_loc[r]:query_start_loc[r + 1]`, the last of its `seq_lens[r]` positions.
        seq_lens (torch.Tensor): `[R]` int32.
        scale (float): logit scale.
        k_scale, v_scale (float): scales of an FP8 KV cache (float8_e4m3fn holding K / k_scale, V / v_scale;
            `paged_args.kv_scaled`). Default: 1.0.
        sparse_block_size (int): positions per oracle block, a multiple of 16.
        topk (int): blocks selected per query and KV group.
        out (torch.Tensor, Optional): `[T, H, Dv]` in q's dtype; every row is written. Default: `None`.
        return_block_scores (bool): also return the group-max scores R (debugging; one host sync).
            Default: `False`.

    Returns:
        out `[T, H, Dv]` (q's dtype), indices `[T, G, topk]` int32 (ascending, -1 padded), and with
        `return_block_scores` the scores `[T, G, ceil(max(seq_lens) / sparse_block_size)]` float32
        (0 where a block has no visible key). Rows past `query_start_loc[-1]` get zeros and -1.
    """
    return oracle_fwd(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale,
                      sparse_block_size=sparse_block_size, topk=topk, out=out,
                      return_block_scores=return_block_scores)
