# SPDX-License-Identifier: Apache-2.0
"""Triton block-sparse paged attention: the global branch of a HySparse sparse layer (SPEC §3.2).

One program per (query token, KV group); the group's query heads are the rows
of the tile, so each gathered K/V tile is loaded once for all of them. The
program walks the token's selected blocks and gathers each block's keys
through the block table (a block may span several pages or share one).

`find_request`, `attend_paged_tile`, `store_rows`, `launch_config` and `gate_args` are
shared with the token-sparse kernel.
"""

import torch
import triton
import triton.language as tl

from csrc_triton.kv_load import widen_fp8
from csrc_triton.paged_args import check_paged_batch, kv_scaled

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def find_request(query_start_loc, num_reqs, i_t):
    """The request whose query rows hold row i_t: the first r with query_start_loc[r + 1] > i_t.

    Rows past the last request (padding) get num_reqs.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid + 1) <= i_t:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def attend_paged_tile(
    b_q, b_m, b_l, b_acc,
    o_p, m_n,
    p_bt, p_k, p_v,
    stride_k_p, stride_k_s, stride_k_d,
    stride_v_p, stride_v_s, stride_v_d,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One online-softmax step (base-2 logits) over the keys at positions o_p where m_n holds.

    p_bt is the request's block-table row, p_k/p_v the group's K/V base pointers.
    Keys are HEAD_DIM wide, values (and b_acc) HEAD_DIM_V wide (SPEC §2.6).
    Masked keys are never read: unwritten cache slots may hold NaN, and 0 * NaN
    would poison the accumulator.
    """
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < HEAD_DIM_V
    # [BLOCK_N] physical page and slot of every key
    i_pg = tl.load(p_bt + o_p // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
    o_slot = (o_p % PAGE_SIZE).to(tl.int64)
    # [BLOCK_D, BLOCK_N]
    b_kt = tl.load(p_k + i_pg[None, :] * stride_k_p + o_slot[None, :] * stride_k_s + o_d[:, None] * stride_k_d,
                   mask=m_d[:, None] & m_n[None, :], other=0.0)
    # [BLOCK_N, BLOCK_DV]
    b_v = tl.load(p_v + i_pg[:, None] * stride_v_p + o_slot[:, None] * stride_v_s + o_dv[None, :] * stride_v_d,
                  mask=m_n[:, None] & m_dv[None, :], other=0.0)
    if DOT_FP32:
        b_kt = b_kt.to(tl.float32)
        b_v = b_v.to(tl.float32)
    else:
        b_kt = widen_fp8(b_kt).to(b_q.dtype)
        b_v = widen_fp8(b_v).to(b_q.dtype)
    # [BLOCK_H, BLOCK_N]
    b_s = tl.dot(b_q, b_kt, input_precision="ieee") * qk_scale
    b_s = tl.where(m_n[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # a row with no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s - b_shift[:, None])
    b_alpha = tl.exp2(b_m - b_shift)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
    return b_m_new, b_l, b_acc


@triton.jit
def store_rows(p_o, b_o, m_hdv, p_gt, i_h, o_dv, stride_g_h, stride_g_d, USE_GATE: tl.constexpr,
               ACCUMULATE: tl.constexpr):
    """Store a program's rows b_o `[BLOCK_H, BLOCK_DV]` (float32) at p_o: as they are, or with USE_GATE through
    the gate of the row at p_gt (heads i_h, dims o_dv): `(out if ACCUMULATE else 0) + sigmoid(gate) * b_o` in
    float32 (SPEC §2.5), as `paged_batch.gated_store` and the C++ kernels' stores (`cpu_gate.h`). A sparse layer's
    two branches then meet in one buffer without a pass over both outputs after the kernels. The callers form the
    output's pointers, and this the gate's, after the key loop: live through it, they spilled 8 B (sm_90,
    `block_sparse-gated` at 3 heads per group, D 128, `tests/kernels_aot`)."""
    if USE_GATE:
        p_g = p_gt + i_h[:, None] * stride_g_h + o_dv[None, :] * stride_g_d
        b_o = b_o * tl.sigmoid(tl.load(p_g, mask=m_hdv, other=0.0).to(tl.float32))
        if ACCUMULATE:
            b_o += tl.load(p_o, mask=m_hdv, other=0.0).to(tl.float32)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_hdv)


def gate_args(gate, accumulate: bool, out) -> dict:
    """The gate's launch arguments (`store_rows`): gate `[T, H, Dv]` float (any strides: a last stride of 0 for
    one gate per head) or None; `accumulate` only with a gate."""
    if gate is None:
        assert not accumulate, "accumulate: only with a gate"
        return dict(gate=out, stride_g_t=0, stride_g_h=0, stride_g_d=0, USE_GATE=False, ACCUMULATE=False)
    assert gate.shape == out.shape and gate.is_floating_point() and gate.device == out.device, \
        f"gate: expected a float {tuple(out.shape)} tensor on {out.device}, got {gate.dtype} {tuple(gate.shape)}"
    return dict(gate=gate, stride_g_t=gate.stride(0), stride_g_h=gate.stride(1), stride_g_d=gate.stride(2),
                USE_GATE=True, ACCUMULATE=accumulate)


@triton.jit
def block_sparse_attn_fwd_kernel(
    q,  # [T, H, D]
    k_cache,  # [num_pages, G, page_size, D]
    v_cache,  # [num_pages, G, page_size, Dv]
    out,  # [T, H, Dv]
    sinks,  # [H] float32, read only when USE_SINKS
    gate,  # [T, H, Dv], read only when USE_GATE
    block_table,  # [R, max_pages] int32
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    block_indices,  # [T, G, K] int32, -1 padded
    qk_scale,  # scale * log2(e)
    num_reqs,
    num_selected,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_g, stride_k_s, stride_k_d,
    stride_v_p, stride_v_g, stride_v_s, stride_v_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_g_t, stride_g_h, stride_g_d,
    stride_bt_r,
    stride_bi_t, stride_bi_g, stride_bi_k,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
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
    p_bi = block_indices + i_t * stride_bi_t + i_g * stride_bi_g
    for i_k in range(num_selected):
        i_b = tl.load(p_bi + i_k * stride_bi_k)
        # skip padding and blocks that start after the query
        if (i_b >= 0) & (i_b * BLOCK_SIZE <= pos):
            for i_n in range(0, BLOCK_SIZE, BLOCK_N):
                o_n = i_n + tl.arange(0, BLOCK_N)
                o_p = i_b * BLOCK_SIZE + o_n
                m_n = (o_n < BLOCK_SIZE) & (o_p <= pos)
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


def launch_config(q, head_dim, heads_per_group, head_dim_v=None):
    """The one fixed config: (BLOCK_H, BLOCK_D, BLOCK_DV, largest BLOCK_N, DOT_FP32, num_warps).

    Chosen from sm_90 AOT builds (ptxas resource usage): a 64-key tile at D <= 128
    with 8 warps, or 32 keys at D = 256, stays under 255 registers without spills.
    The wider of the q/k and v head dims decides (192 / 128 tiles as 256 / 128).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    # tl.dot needs M >= 16 on GPUs; padded head rows are masked on load and store
    block_h = max(16, triton.next_power_of_2(heads_per_group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    widest = max(block_d, block_dv)
    block_n = 64 if widest <= 128 else 32
    num_warps = 8 if widest >= 128 else 4
    # the interpreter multiplies bf16 bit patterns in tl.dot, so dot in fp32 there
    dot_fp32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu")
    return block_h, block_d, block_dv, block_n, dot_fp32, num_warps


@kv_scaled
def block_sparse_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, block_indices, *,
                           scale, sparse_block_size, sinks=None, out=None, gate=None, accumulate=False):
    """Attention of every query row over the keys of its selected blocks (SPEC §3.2 global branch).

    Args:
        q (torch.Tensor): `[T, H, D]`, any strides; fp16, bf16 or fp32.
        k_cache (torch.Tensor): `[num_pages, G, page_size, D]`, any strides; q's dtype or float8_e4m3fn.
        v_cache (torch.Tensor): `[num_pages, G, page_size, Dv]`, any strides, k_cache's dtype (Dv may differ from D).
        block_table (torch.Tensor): `[R, max_pages]` int32; position p of request r is in page
            `block_table[r, p // page_size]`, slot `p % page_size`.
        query_start_loc (torch.Tensor): `[R + 1]` int32; request r owns rows
            `query_start_loc[r]:query_start_loc[r + 1]`, the last of its `seq_lens[r]` positions.
        seq_lens (torch.Tensor): `[R]` int32.
        block_indices (torch.Tensor): `[T, G, K]` int32 block ids (positions
            `[b * sparse_block_size, (b + 1) * sparse_block_size)`), unique, -1 padded.
        scale (float): logit scale.
        k_scale, v_scale (float): scales of an FP8 KV cache (float8_e4m3fn holding K / k_scale, V / v_scale;
            `paged_args.kv_scaled`). Default: 1.0.
        sparse_block_size (int): positions per block.
        sinks (torch.Tensor, Optional): `[H]` sink logits (unscaled, no value). Default: `None`.
        out (torch.Tensor, Optional): `[T, H, Dv]` in q's dtype; every element is written. Default: `None`.
        gate (torch.Tensor, Optional): `[T, H, Dv]`, any float dtype and strides (a last stride of 0: one gate
            per head): rows are stored as `sigmoid(gate) * attention` (SPEC §2.5), in float32. Default: `None`.
        accumulate (bool): with `gate`, add the gated rows to `out`'s instead (a sparse layer's second branch).

    Returns:
        `[T, H, Dv]` in q's dtype. Keys are the selected positions at or before the query;
        rows past `query_start_loc[-1]` and rows with neither keys nor sink are 0 (their gated term too).
    """
    out, sinks = check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out, sinks)
    gating = gate_args(gate, accumulate, out)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert block_indices.dim() == 3 and block_indices.shape[:2] == (num_tokens, num_kv_heads), \
        f"block_indices: expected [{num_tokens}, {num_kv_heads}, K], got {tuple(block_indices.shape)}"
    assert block_indices.dtype == torch.int32, "block_indices must be int32"
    assert sparse_block_size > 0, "sparse_block_size must be positive"
    if num_tokens == 0:
        return out
    heads_per_group = num_heads // num_kv_heads
    head_dim_v = v_cache.shape[3]
    block_h, block_d, block_dv, block_n, dot_fp32, num_warps = launch_config(q, head_dim, heads_per_group,
                                                                              head_dim_v)
    block_n = max(16, min(block_n, triton.next_power_of_2(sparse_block_size)))
    grid = (num_tokens, num_kv_heads)
    block_sparse_attn_fwd_kernel[grid](
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        out=out,
        sinks=sinks if sinks is not None else q,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_indices=block_indices,
        **gating,
        qk_scale=float(scale) * LOG2E.value,
        num_reqs=seq_lens.shape[0],
        num_selected=block_indices.shape[2],
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
        stride_k_p=k_cache.stride(0), stride_k_g=k_cache.stride(1),
        stride_k_s=k_cache.stride(2), stride_k_d=k_cache.stride(3),
        stride_v_p=v_cache.stride(0), stride_v_g=v_cache.stride(1),
        stride_v_s=v_cache.stride(2), stride_v_d=v_cache.stride(3),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_bt_r=block_table.stride(0),
        stride_bi_t=block_indices.stride(0), stride_bi_g=block_indices.stride(1),
        stride_bi_k=block_indices.stride(2),
        HEADS_PER_GROUP=heads_per_group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        PAGE_SIZE=k_cache.shape[2],
        BLOCK_SIZE=sparse_block_size,
        USE_SINKS=sinks is not None,
        DOT_FP32=dot_fp32,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out
