# SPDX-License-Identifier: Apache-2.0
"""Triton token oracle attention: causal paged attention plus the HySparse2 token selection (SPEC §3.3).

Two passes over the keys of every (query rows, KV group) program, each split
over up to NUM_SPLITS key ranges:

1. `token_oracle_stats_kernel`: online softmax; writes each row's partial
   output, running max and denominator per split.
2. `token_oracle_score_kernel`: merges the partials into the output and every
   head's exact log-sum-exp, then recomputes the logits of the candidate keys
   (before the recent window), turns them into exact probabilities, reduces
   them over the group's heads (max or sum) and writes one sortable int64 key
   per (row, group, position) to a scratch buffer.

The launcher takes the top-k of the scratch keys with `torch.topk` (keys are
unique, so ties go to the smaller position) and appends the window. See
README.md for the design and its memory.
"""

import torch
import triton
import triton.language as tl

from csrc_triton.oracle.tile import dot_in_fp32, find_request
from csrc_triton.paged_args import check_paged_batch, kv_scaled

LOG2E = 1.4426950408889634
# vLLM's rule for its split-KV decode: split while requests x KV groups leave the GPU under-filled
SPLIT_KV_MAX_PROGRAMS = 128
MAX_SPLITS = 16
# query rows x heads per program on the many-rows path (64 spills at head dim 128)
PREFILL_ROWS = 32
# cap on the top-k scratch buffer; rows are processed in chunks that fit
SCRATCH_BYTES = 256 << 20
# candidate key = (fp32 bits of R) * 2^31 + (2^31 - 1 - j): R >= 0, so a larger key is a larger R, then a smaller j
POS_MASK = (1 << 31) - 1
NO_ID = 1 << 40


@triton.jit
def locate_program(query_start_loc, num_reqs, i_p, BLOCK_Q: tl.constexpr):
    """(request, its first row, its number of rows, q-block within the request) of program `i_p`.

    With BLOCK_Q = 1 program i_p is row i_p. Otherwise request r's q-blocks are
    numbered from `query_start_loc[r] // BLOCK_Q + r` (vLLM's static bound).
    """
    if BLOCK_Q == 1:
        i_r = find_request(query_start_loc, num_reqs, i_p, BLOCK_Q=1, BY_BLOCK=False)
    else:
        i_r = find_request(query_start_loc, num_reqs, i_p, BLOCK_Q=BLOCK_Q, BY_BLOCK=True)
    bos = tl.load(query_start_loc + i_r)
    q_len = tl.load(query_start_loc + i_r + 1) - bos
    if BLOCK_Q == 1:
        i_qs = i_p - bos
    else:
        i_qs = i_p - (bos // BLOCK_Q + i_r)
    return i_r, bos, q_len, i_qs


@triton.jit
def row_layout(i_g, i_qs, bos, q_len, seq_len, num_real, num_tokens,
               HEADS_PER_GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row m of a program is query m // BLOCK_H of its q-block and head m % BLOCK_H of group i_g.

    Returns `[BLOCK_M]` token ids, head ids, real-row mask, padding-row mask
    (past the last request, still to be written) and positions (-1 off real rows).
    """
    o_m = tl.arange(0, BLOCK_M)
    o_qi = o_m // BLOCK_H
    o_q = i_qs * BLOCK_Q + o_qi
    o_t = (bos + o_q).to(tl.int64)
    m_h = ((o_m % BLOCK_H) < HEADS_PER_GROUP) & (o_qi < BLOCK_Q)
    i_h = i_g * HEADS_PER_GROUP + (o_m % BLOCK_H)
    m_row = m_h & (o_q < q_len)
    m_pad = m_h & (o_t >= num_real) & (o_t < num_tokens)
    o_pos = tl.where(m_row, seq_len - q_len + o_q, -1)
    return o_t, i_h, m_row, m_pad, o_pos


@triton.jit
def key_logits(b_q, i_n, kv_len, p_bt, p_k, stride_k_p, stride_k_s, stride_k_d, qk_scale,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               DOT_FP32: tl.constexpr):
    """Base-2 logits `[BLOCK_M, BLOCK_N]` of key tile `i_n` (keys >= kv_len are not read; their logits are
    meaningless), with the keys' positions, validity, pages and slots."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < kv_len
    # [BLOCK_N] physical page and slot of every key; int64 before any stride multiply
    i_pg = tl.load(p_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
    o_slot = (o_n % PAGE_SIZE).to(tl.int64)
    # [BLOCK_D, BLOCK_N]
    b_kt = tl.load(p_k + i_pg[None, :] * stride_k_p + o_slot[None, :] * stride_k_s + o_d[:, None] * stride_k_d,
                   mask=(o_d < HEAD_DIM)[:, None] & m_n[None, :], other=0.0)
    if DOT_FP32:
        b_s = tl.dot(b_q, b_kt.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        b_s = tl.dot(b_q, b_kt.to(b_q.dtype)) * qk_scale
    return b_s, o_n, m_n, i_pg, o_slot


@triton.jit
def token_oracle_stats_kernel(
    q,  # [T, H, D]
    k_cache,  # [num_pages, G, page_size, D]
    v_cache,  # [num_pages, G, page_size, Dv]
    part_o,  # [T, H, NUM_SPLITS, BLOCK_DV] float32, unnormalised
    part_m,  # [T, H, NUM_SPLITS] float32 base-2 running max
    part_l,  # [T, H, NUM_SPLITS] float32 softmax denominator
    block_table,  # [R, max_pages] int32
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    qk_scale,  # scale * log2(e)
    num_reqs,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_g, stride_k_s, stride_k_d,
    stride_v_p, stride_v_g, stride_v_s, stride_v_d,
    stride_bt_r,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Pass 1: the online-softmax partials of one split of the keys of one q-block and KV group."""
    i_p = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    num_heads = tl.num_programs(1) * HEADS_PER_GROUP
    i_r, bos, q_len, i_qs = locate_program(query_start_loc, num_reqs, i_p, BLOCK_Q=BLOCK_Q)
    if i_qs * BLOCK_Q >= q_len:
        # no real row (padding tokens, or past the request's last q-block): pass 2 writes what is due
        return
    seq_len = tl.load(seq_lens + i_r)
    # no padding rows here (num_real = num_tokens = 0)
    o_t, i_h, m_row, _m_pad, o_pos = row_layout(i_g, i_qs, bos, q_len, seq_len, 0, 0, HEADS_PER_GROUP=HEADS_PER_GROUP,
                                                BLOCK_Q=BLOCK_Q, BLOCK_H=BLOCK_H, BLOCK_M=BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    # values (and the partial outputs) are HEAD_DIM_V wide (SPEC §2.6)
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < HEAD_DIM_V
    # [BLOCK_M, BLOCK_D]
    b_q = tl.load(q + o_t[:, None] * stride_q_t + i_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d,
                  mask=m_row[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)

    # keys up to the block's last query, split into NUM_SPLITS contiguous tile ranges
    kv_len = seq_len - q_len + tl.minimum((i_qs + 1) * BLOCK_Q, q_len)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    i_start = i_s * per_split
    i_end = tl.minimum(i_start + per_split, n_tiles)
    p_bt = block_table + i_r.to(tl.int64) * stride_bt_r
    p_k = k_cache + i_g * stride_k_g
    p_v = v_cache + i_g * stride_v_g
    for i_n in range(i_start, i_end):
        b_s, o_n, m_n, i_pg, o_slot = key_logits(b_q, i_n, kv_len, p_bt, p_k, stride_k_p, stride_k_s, stride_k_d,
                                                 qk_scale, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N,
                                                 BLOCK_D=BLOCK_D, DOT_FP32=DOT_FP32)
        b_s = tl.where((o_n[None, :] <= o_pos[:, None]) & m_n[None, :], b_s, float("-inf"))
        b_mt = tl.maximum(b_m, tl.max(b_s, axis=1))
        # a row with no key yet keeps m = -inf and shifts by 0 so exp2 gives 0, not NaN
        b_shift = tl.where(b_mt == float("-inf"), 0.0, b_mt)
        b_p = tl.exp2(b_s - b_shift[:, None])
        b_alpha = tl.exp2(b_m - b_shift)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_m = b_mt
        # [BLOCK_N, BLOCK_DV]; masked so NaN in unwritten slots never reaches 0 * NaN
        b_v = tl.load(p_v + i_pg[:, None] * stride_v_p + o_slot[:, None] * stride_v_s + o_dv[None, :] * stride_v_d,
                      mask=m_n[:, None] & m_dv[None, :], other=0.0)
        if DOT_FP32:
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype))

    # every split stores, an empty one too (m = -inf, l = 0, acc = 0)
    i_part = (o_t * num_heads + i_h) * NUM_SPLITS + i_s
    tl.store(part_o + i_part[:, None] * BLOCK_DV + o_dv[None, :], b_acc, mask=m_row[:, None])
    tl.store(part_m + i_part, b_m, mask=m_row)
    tl.store(part_l + i_part, b_l, mask=m_row)


@triton.jit
def token_oracle_score_kernel(
    q,  # [T, H, D]
    k_cache,  # [num_pages, G, page_size, D]
    out,  # [T, H, Dv]
    part_o, part_m, part_l,  # pass-1 partials, see token_oracle_stats_kernel
    row_pos,  # [T] int32 query position of every row, -1 for padding rows
    keys,  # [row_hi - row_lo, G, key_width] int64 candidate keys, -1 where never written
    block_table,  # [R, max_pages] int32
    query_start_loc,  # [R + 1] int32
    seq_lens,  # [R] int32
    qk_scale,  # scale * log2(e)
    num_tokens,
    num_reqs,
    recent_window,
    row_lo,  # this launch handles rows [row_lo, row_hi)
    row_hi,
    prog_offset,  # program i runs q-block i + prog_offset
    key_width,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_g, stride_k_s, stride_k_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_bt_r,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    REDUCE_SUM: tl.constexpr,
    SCORE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Pass 2: merge the partials (output, exact LSE), then score one split of the candidate keys."""
    QR: tl.constexpr = BLOCK_M // BLOCK_H
    i_p = tl.program_id(0) + prog_offset
    i_g = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_heads = num_kv_heads * HEADS_PER_GROUP
    i_r, bos, q_len, i_qs = locate_program(query_start_loc, num_reqs, i_p, BLOCK_Q=BLOCK_Q)
    first = bos + i_qs * BLOCK_Q
    if (first >= row_hi) | (first + BLOCK_Q <= row_lo):
        return
    num_real = tl.load(query_start_loc + num_reqs)
    seq_len = tl.load(seq_lens + i_r)
    o_t, i_h, m_row, m_pad, _o_pos = row_layout(i_g, i_qs, bos, q_len, seq_len, num_real, num_tokens,
                                                HEADS_PER_GROUP=HEADS_PER_GROUP, BLOCK_Q=BLOCK_Q, BLOCK_H=BLOCK_H,
                                                BLOCK_M=BLOCK_M)
    m_chunk = (o_t >= row_lo) & (o_t < row_hi)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < HEAD_DIM_V

    # merge the splits by log-sum-exp; empty splits have m = -inf and weigh 0
    i_row = (o_t * num_heads + i_h) * NUM_SPLITS
    b_mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i_sp in range(NUM_SPLITS):
        b_mx = tl.maximum(b_mx, tl.load(part_m + i_row + i_sp, mask=m_row, other=float("-inf")))
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    for i_sp in range(NUM_SPLITS):
        b_ws = tl.exp2(tl.load(part_m + i_row + i_sp, mask=m_row, other=float("-inf")) - b_mx)
        b_l += b_ws * tl.load(part_l + i_row + i_sp, mask=m_row, other=0.0)
    b_l = tl.where(b_l > 0, b_l, 1.0)
    # the head's exact base-2 log-sum-exp over all keys j <= t
    b_lse = b_mx + tl.log2(b_l)

    # [QR] the q-block's queries (QR >= BLOCK_Q when rows are padded up to 16)
    o_qi = tl.arange(0, QR)
    o_qq = i_qs * BLOCK_Q + o_qi
    o_tq = (bos + o_qq).to(tl.int64)
    m_q = (o_qi < BLOCK_Q) & (o_qq < q_len)
    m_qpad = (o_qi < BLOCK_Q) & (o_tq >= num_real) & (o_tq < num_tokens)
    m_qchunk = (o_tq >= row_lo) & (o_tq < row_hi)
    pos_q = seq_len - q_len + o_qq
    if i_s == 0:
        p_po = part_o + (i_row * BLOCK_DV)[:, None] + o_dv[None, :]
        b_o = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for i_sp in range(NUM_SPLITS):
            b_ws = tl.exp2(tl.load(part_m + i_row + i_sp, mask=m_row, other=float("-inf")) - b_mx)
            b_o += b_ws[:, None] * tl.load(p_po + i_sp * BLOCK_DV, mask=m_row[:, None], other=0.0)
        b_o = b_o / b_l[:, None]
        # padding rows past the last request get zeros
        tl.store(out + o_t[:, None] * stride_o_t + i_h[:, None] * stride_o_h + o_dv[None, :] * stride_o_d,
                 b_o.to(out.dtype.element_ty), mask=((m_row | m_pad) & m_chunk)[:, None] & m_dv[None, :])
        tl.store(row_pos + o_tq, tl.where(m_q, pos_q, -1), mask=(m_q | m_qpad) & m_qchunk)

    if SCORE:
        # candidates of query t: keys j < t - recent_window + 1 (before the window, hence visible)
        cand_end = tl.where(m_q & m_qchunk, pos_q - recent_window + 1, 0)
        cand_len = tl.maximum(tl.max(cand_end, axis=0), 0)
        n_tiles = tl.cdiv(cand_len, BLOCK_N)
        per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        i_start = i_s * per_split
        i_end = tl.minimum(i_start + per_split, n_tiles)
        b_q = tl.load(q + o_t[:, None] * stride_q_t + i_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d,
                      mask=m_row[:, None] & m_d[None, :], other=0.0)
        if DOT_FP32:
            b_q = b_q.to(tl.float32)
        p_bt = block_table + i_r.to(tl.int64) * stride_bt_r
        p_k = k_cache + i_g * stride_k_g
        p_key = keys + ((o_tq - row_lo) * num_kv_heads + i_g) * key_width
        for i_n in range(i_start, i_end):
            # (distinct dummy names: triton 3.6 types `_` as one loop-carried variable)
            b_s, o_n, m_n, _i_pg, _o_slot = key_logits(b_q, i_n, cand_len, p_bt, p_k, stride_k_p, stride_k_s,
                                                       stride_k_d, qk_scale, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE,
                                                       BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_FP32=DOT_FP32)
            # exact probabilities P_h = exp2(z - lse); padded heads and rows count 0 in max and sum
            b_p = tl.where(m_row[:, None], tl.exp2(b_s - b_lse[:, None]), 0.0)
            b_p3 = tl.reshape(b_p, (QR, BLOCK_H, BLOCK_N))
            if REDUCE_SUM:
                b_r = tl.sum(b_p3, axis=1)
            else:
                b_r = tl.max(b_p3, axis=1)
            # [QR, BLOCK_N] unique sortable keys: R's bits (R >= 0 is monotone as an integer), then -position
            b_key = b_r.to(tl.int32, bitcast=True).to(tl.int64) * 2147483648 + (2147483647 - o_n)[None, :]
            m_c = m_q[:, None] & m_qchunk[:, None] & (o_n[None, :] < cand_end[:, None]) & m_n[None, :]
            tl.store(p_key[:, None] + o_n[None, :], b_key, mask=m_c)


def check_args(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, topk_tokens, recent_window,
               score_head_reduce, out):
    """The shared paged-batch checks plus the token oracle's own; returns `out`, allocated when None."""
    assert topk_tokens >= 0 and recent_window >= 0 and topk_tokens + recent_window >= 1, \
        f"need topk_tokens, recent_window >= 0 with a positive sum (got {topk_tokens}, {recent_window})"
    if score_head_reduce not in ("max", "sum"):
        raise ValueError(f"score_head_reduce: must be 'max' or 'sum' (got {score_head_reduce!r})")
    return check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)[0]


def default_num_splits(num_tokens, num_reqs, num_kv_heads, max_keys, block_n):
    """KV splits per program, from shapes only (no host sync).

    Decode batches (`num_tokens == num_reqs`) that leave the GPU under-filled
    split the keys, with at least 4 key tiles per split; anything else runs 1 split.
    """
    if num_tokens != num_reqs or num_reqs * num_kv_heads > SPLIT_KV_MAX_PROGRAMS:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, max_keys // (4 * block_n))))


def launch_config(head_dim, heads_per_group, page_size, block_q, dot_fp32, head_dim_v=None):
    """The one fixed config of both kernels (without NUM_SPLITS), as launch keywords.

    Chosen from sm_90 AOT builds with triton 3.9: with these, no tested (heads per group,
    head dim) spills, where 4 warps spill from head dim 80 up and 64-row blocks spill at 128.
    tests/kernels_aot builds them at the presets' shapes (triton 3.6 too: see num_warps).
    With a value head dim of its own (SPEC §2.6) the wider of the two sets the tiles.
    """
    assert block_q >= 1 and block_q & (block_q - 1) == 0, f"block_q must be a power of two (got {block_q})"
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    block_h = triton.next_power_of_2(heads_per_group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    widest = max(block_d, block_dv)
    # 64-key tiles; 32 at head dim 256, on the many-rows path at 128, and for ieee fp32 dots
    block_n = 32 if (dot_fp32 or widest > 128 or (block_q > 1 and widest >= 128)) else 64
    return {
        "HEADS_PER_GROUP": heads_per_group, "HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim_v, "PAGE_SIZE": page_size,
        "BLOCK_Q": block_q, "BLOCK_H": block_h,
        # tl.dot needs at least 16 rows on GPUs; padded rows are masked
        "BLOCK_M": max(16, block_q * block_h),
        "BLOCK_N": block_n, "BLOCK_D": block_d, "BLOCK_DV": block_dv, "DOT_FP32": dot_fp32,
        # 8 warps spill 12 B on the many-rows 32-row tiles at head dim 128 with triton 3.6, and 4 B on
        # one-row programs at q/k 192 (tiled as 256) with v 128; 4 warps do not (sm_90 AOT builds)
        "num_warps": 4 if widest < 64 or (block_q > 1 and widest == 128) or (block_q == 1 and block_d != block_dv)
        else 8,
    }


def finish_selection(keys, pos, num_kv_heads, topk_tokens, recent_window):
    """Top-k of the scratch keys plus the window: `[n, G, topk_tokens + recent_window]` int32 positions.

    Args:
        keys: `[n, G, key_width]` int64 candidate keys (-1: no candidate), or None when topk_tokens is 0.
        pos: `[n]` int32 row positions, -1 for padding rows.
    """
    parts = []
    if topk_tokens > 0:
        top = torch.topk(keys, topk_tokens, dim=-1, sorted=False).values
        parts.append(torch.where(top >= 0, POS_MASK - (top & POS_MASK), NO_ID))
    if recent_window > 0:
        pos = pos.long()
        win = pos[:, None] - recent_window + 1 + torch.arange(recent_window, device=pos.device)
        win = torch.where((win >= 0) & (pos[:, None] >= 0), win, NO_ID)
        parts.append(win[:, None, :].expand(-1, num_kv_heads, -1))
    # the picked positions all precede the window; one sort moves the missing ones (NO_ID) to the end
    ids = torch.cat(parts, dim=-1).sort(dim=-1).values
    return ids.masked_fill(ids == NO_ID, -1).to(torch.int32)


def token_oracle_fwd(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, topk_tokens,
                     recent_window, score_head_reduce="max", out=None, num_splits=None, block_q=None,
                     scratch_bytes=SCRATCH_BYTES, max_seq_len=None):
    """`token_oracle_attention` with the launch choices exposed (tests).

    Args:
        num_splits (int, Optional): KV splits per program, a power of two. Default: `None` (from shapes).
        block_q (int, Optional): query rows per program, a power of two; 1 is the decode layout.
            Default: `None` (1 for decode batches, else `PREFILL_ROWS // heads per group`).
        scratch_bytes (int): cap on the top-k scratch buffer; at least one row is always processed.
        max_seq_len (int, Optional): a host bound on `seq_lens` (vLLM's metadata has one); it bounds
            the scratch and its top-k by the step's sequences instead of the block table's capacity.
    """
    out = check_args(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, topk_tokens, recent_window,
                     score_head_reduce, out)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_reqs = seq_lens.shape[0]
    page_size = k_cache.shape[2]
    indices = torch.empty((num_tokens, num_kv_heads, topk_tokens + recent_window), dtype=torch.int32,
                          device=q.device)
    if num_reqs == 0 or num_tokens == 0:
        out.zero_()
        indices.fill_(-1)
        return out, indices

    dot_fp32 = dot_in_fp32(q)
    max_keys = block_table.shape[1] * page_size
    if max_seq_len is not None:
        max_keys = min(max_keys, -(-max_seq_len // page_size) * page_size)
    heads_per_group = num_heads // num_kv_heads
    if block_q is None:
        block_q = 1 if num_tokens == num_reqs else max(1, PREFILL_ROWS // triton.next_power_of_2(heads_per_group))
    meta = launch_config(head_dim, heads_per_group, page_size, block_q, dot_fp32, v_cache.shape[3])
    if num_splits is None:
        num_splits = default_num_splits(num_tokens, num_reqs, num_kv_heads, max_keys, meta["BLOCK_N"])
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, \
        f"num_splits must be a power of two (got {num_splits})"
    meta["NUM_SPLITS"] = num_splits
    block_dv = meta["BLOCK_DV"]
    num_programs = num_tokens if block_q == 1 else num_tokens // block_q + num_reqs
    qk_scale = float(scale) * LOG2E
    q_strides = {"stride_q_t": q.stride(0), "stride_q_h": q.stride(1), "stride_q_d": q.stride(2)}
    k_strides = {"stride_k_p": k_cache.stride(0), "stride_k_g": k_cache.stride(1), "stride_k_s": k_cache.stride(2),
                 "stride_k_d": k_cache.stride(3)}

    part_o = torch.empty((num_tokens, num_heads, num_splits, block_dv), dtype=torch.float32, device=q.device)
    part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    token_oracle_stats_kernel[(num_programs, num_kv_heads, num_splits)](
        q=q, k_cache=k_cache, v_cache=v_cache, part_o=part_o, part_m=part_m, part_l=part_l,
        block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
        qk_scale=qk_scale, num_reqs=num_reqs, **q_strides, **k_strides,
        stride_v_p=v_cache.stride(0), stride_v_g=v_cache.stride(1), stride_v_s=v_cache.stride(2),
        stride_v_d=v_cache.stride(3),
        stride_bt_r=block_table.stride(0),
        **meta,
    )

    # one int64 key per (row, group, candidate position); candidates precede the window, so < max_keys - window
    key_width = max(max_keys - recent_window, topk_tokens, 1)
    score = topk_tokens > 0
    chunk = max(1, scratch_bytes // (num_kv_heads * key_width * 8)) if score else num_tokens
    chunk = min(chunk, num_tokens)
    keys = torch.empty((chunk if score else 1, num_kv_heads, key_width if score else 1), dtype=torch.int64,
                       device=q.device)
    row_pos = torch.empty(num_tokens, dtype=torch.int32, device=q.device)
    for lo in range(0, num_tokens, chunk):
        hi = min(num_tokens, lo + chunk)
        if score:
            keys[: hi - lo].fill_(-1)
        token_oracle_score_kernel[(hi - lo if block_q == 1 else num_programs, num_kv_heads, num_splits)](
            q=q, k_cache=k_cache, out=out, part_o=part_o, part_m=part_m, part_l=part_l, row_pos=row_pos, keys=keys,
            block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
            qk_scale=qk_scale, num_tokens=num_tokens, num_reqs=num_reqs, recent_window=recent_window,
            row_lo=lo, row_hi=hi, prog_offset=lo if block_q == 1 else 0, key_width=key_width,
            **q_strides, **k_strides,
            stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
            stride_bt_r=block_table.stride(0),
            REDUCE_SUM=score_head_reduce == "sum", SCORE=score,
            **meta,
        )
        indices[lo:hi] = finish_selection(keys[: hi - lo] if score else None, row_pos[lo:hi], num_kv_heads,
                                          topk_tokens, recent_window)
    return out, indices


@kv_scaled
def token_oracle_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale, topk_tokens,
                           recent_window, score_head_reduce="max", out=None, max_seq_len=None):
    """Causal paged attention of a HySparse2 cross full layer and its token selection S_t (SPEC §3.3).

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
        topk_tokens (int): k_g, positions picked outside the window per query and KV group.
        recent_window (int): w, the window `[max(0, t - w + 1), t]` always kept.
        score_head_reduce (str): `"max"` or `"sum"` of the exact probabilities over a group's heads.
            Default: `"max"`.
        out (torch.Tensor, Optional): `[T, H, Dv]` in q's dtype; every row is written. Default: `None`.

    Returns:
        out `[T, H, Dv]` (causal attention, no sink) and token_indices `[T, G, topk_tokens + recent_window]`
        int32: `S_t` ascending, -1 padded at the end (`|S_t| = min(t + 1, topk_tokens + recent_window)`).
        Rows past `query_start_loc[-1]` get zeros and -1.
    """
    return token_oracle_fwd(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale,
                            topk_tokens=topk_tokens, recent_window=recent_window,
                            score_head_reduce=score_head_reduce, out=out, max_seq_len=max_seq_len)
