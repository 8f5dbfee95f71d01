# SPDX-License-Identifier: Apache-2.0
"""Triton token-sparse paged attention: the HySparse2 cross sparse layer (SPEC §3.3).

One program per (query token, KV group), the group's query heads as rows. The
program reads the token's selected key positions `S_t` (window ∪ top-k, given
explicitly) in tiles of BLOCK_N, gathers each key through the block table and
runs one sink softmax over all of them.
"""

import torch
import triton
import triton.language as tl

from csrc_triton.block_sparse.kernel import LOG2E, attend_paged_tile, find_request, gate_args, launch_config, store_rows
from csrc_triton.paged_args import check_paged_batch, kv_scaled


@triton.jit
def token_sparse_attn_fwd_kernel(
    q,  # [T, H, D]
    k_cache,  # [num_pages, G, page_size, D]
    v_cache,  # [num_pages, G, page_size, Dv]
    out,  # [T, H, Dv]
    sinks,  # [H] float32, read only when USE_SINKS
    gate,  # [T, H, Dv], read only when USE_GATE
    block_table,  # [R, max_pages] int32
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    token_indices,  # [T, G, S] int32 key positions, -1 padded
    qk_scale,  # scale * log2(e)
    num_reqs,
    num_selected,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_g, stride_k_s, stride_k_d,
    stride_v_p, stride_v_g, stride_v_s, stride_v_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_g_t, stride_g_h, stride_g_d,
    stride_bt_r,
    stride_ti_t, stride_ti_g, stride_ti_s,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_GATE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    i_h = i_g * HEADS_PER_GROUP + o_h
    m_hd = (o_h < HEADS_PER_GROUP)[:, None] & (o_d < HEAD_DIM)[None, :]
    m_hdv = (o_h < HEADS_PER_GROUP)[:, None] & (o_dv < HEAD_DIM_V)[None, :]

    i_r = find_request(query_start_loc, num_reqs, i_t.to(tl.int32))
    if i_r >= num_reqs:
        # a padding row past the last request: write zeros (its gated term is 0 too), never leave stale memory
        p_o = out + i_t * stride_o_t + i_h[:, None] * stride_o_h + o_dv[None, :] * stride_o_d
        store_rows(p_o, tl.zeros([BLOCK_H, BLOCK_DV], tl.float32), m_hdv, gate + i_t * stride_g_t,
                   i_h, o_dv, stride_g_h, stride_g_d, USE_GATE, ACCUMULATE)
        return
    bos = tl.load(query_start_loc + i_r)
    eos = tl.load(query_start_loc + i_r + 1)
    seq_len = tl.load(seq_lens + i_r)
    # queries are the last (eos - bos) positions of the request; pos < seq_len
    pos = seq_len - (eos - bos) + (i_t.to(tl.int32) - bos)

    # [BLOCK_H, BLOCK_D]
    b_q = tl.load(q + i_t * stride_q_t + i_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d, mask=m_hd, other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    if USE_SINKS:
        # the sink is a logit with no value: it starts the running max with weight exp(0) = 1
        b_m = tl.load(sinks + i_h, mask=o_h < HEADS_PER_GROUP, other=0.0).to(tl.float32) * LOG2E
        b_l = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_H], tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    p_bt = block_table + i_r.to(tl.int64) * stride_bt_r
    p_k = k_cache + i_g * stride_k_g
    p_v = v_cache + i_g * stride_v_g
    p_ti = token_indices + i_t * stride_ti_t + i_g * stride_ti_g
    for i_s in range(0, num_selected, BLOCK_N):
        o_s = i_s + tl.arange(0, BLOCK_N)
        # [BLOCK_N] key positions; -1 padding and anything after the query are masked
        o_p = tl.load(p_ti + o_s * stride_ti_s, mask=o_s < num_selected, other=-1)
        m_n = (o_p >= 0) & (o_p <= pos)
        # padding sits at the end of the list: skip tiles holding nothing but padding
        if tl.max(m_n.to(tl.int32), 0) > 0:
            b_m, b_l, b_acc = attend_paged_tile(
                b_q, b_m, b_l, b_acc, o_p, m_n, p_bt, p_k, p_v,
                stride_k_p, stride_k_s, stride_k_d,
                stride_v_p, stride_v_s, stride_v_d,
                qk_scale,
                HEAD_DIM=HEAD_DIM,
                HEAD_DIM_V=HEAD_DIM_V,
                PAGE_SIZE=PAGE_SIZE,
                BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV,
                DOT_FP32=DOT_FP32,
            )
    # no key and no sink: l = 0 and the output is 0
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o = out + i_t * stride_o_t + i_h[:, None] * stride_o_h + o_dv[None, :] * stride_o_d  # after the loop (store_rows)
    store_rows(p_o, b_o, m_hdv, gate + i_t * stride_g_t, i_h, o_dv, stride_g_h, stride_g_d, USE_GATE, ACCUMULATE)


@kv_scaled
def token_sparse_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, token_indices, *,
                           scale, sinks=None, out=None, gate=None, accumulate=False):
    """One sink softmax of every query row over its selected key positions (SPEC §3.3 cross sparse layer).

    Args:
        q (torch.Tensor): `[T, H, D]`, any strides; fp16, bf16 or fp32.
        k_cache (torch.Tensor): `[num_pages, G, page_size, D]`, any strides; q's dtype or float8_e4m3fn.
        v_cache (torch.Tensor): `[num_pages, G, page_size, Dv]`, any strides, k_cache's dtype (Dv may differ from D).
        block_table (torch.Tensor): `[R, max_pages]` int32; position p of request r is in page
            `block_table[r, p // page_size]`, slot `p % page_size`.
        query_start_loc (torch.Tensor): `[R + 1]` int32; request r owns rows
            `query_start_loc[r]:query_start_loc[r + 1]`, the last of its `seq_lens[r]` positions.
        seq_lens (torch.Tensor): `[R]` int32.
        token_indices (torch.Tensor): `[T, G, S]` int32 key positions, unique, -1 padded at the end.
        scale (float): logit scale.
        k_scale, v_scale (float): scales of an FP8 KV cache (float8_e4m3fn holding K / k_scale, V / v_scale;
            `paged_args.kv_scaled`). Default: 1.0.
        sinks (torch.Tensor, Optional): `[H]` sink logits (unscaled, no value). Default: `None`.
        out (torch.Tensor, Optional): `[T, H, Dv]` in q's dtype; every element is written. Default: `None`.
        gate, accumulate: the rows stored through a gate, or added to `out`'s (`block_sparse_attention`'s).

    Returns:
        `[T, H, Dv]` in q's dtype. Positions after the query are ignored; rows past
        `query_start_loc[-1]` and rows with neither keys nor sink are 0 (their gated term too).
    """
    out, sinks = check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, sinks)
    gating = gate_args(gate, accumulate, out)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert token_indices.dim() == 3 and token_indices.shape[:2] == (num_tokens, num_kv_heads), \
        f"token_indices: expected [{num_tokens}, {num_kv_heads}, S], got {tuple(token_indices.shape)}"
    assert token_indices.dtype == torch.int32, "token_indices must be int32"
    if num_tokens == 0:
        return out
    heads_per_group = num_heads // num_kv_heads
    head_dim_v = v_cache.shape[3]
    block_h, block_d, block_dv, block_n, dot_fp32, num_warps = launch_config(q, head_dim, heads_per_group,
                                                                              head_dim_v)
    grid = (num_tokens, num_kv_heads)
    token_sparse_attn_fwd_kernel[grid](
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        out=out,
        sinks=sinks if sinks is not None else q,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        token_indices=token_indices,
        **gating,
        qk_scale=float(scale) * LOG2E.value,
        num_reqs=seq_lens.shape[0],
        num_selected=token_indices.shape[2],
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_p=k_cache.stride(0), stride_k_g=k_cache.stride(1),
        stride_k_s=k_cache.stride(2), stride_k_d=k_cache.stride(3),
        stride_v_p=v_cache.stride(0), stride_v_g=v_cache.stride(1),
        stride_v_s=v_cache.stride(2), stride_v_d=v_cache.stride(3),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_bt_r=block_table.stride(0),
        stride_ti_t=token_indices.stride(0), stride_ti_g=token_indices.stride(1),
        stride_ti_s=token_indices.stride(2),
        HEADS_PER_GROUP=heads_per_group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        PAGE_SIZE=k_cache.shape[2],
        USE_SINKS=sinks is not None,
        DOT_FP32=dot_fp32,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out
