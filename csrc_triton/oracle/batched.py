# SPDX-License-Identifier: Apache-2.0
"""Oracle attention on the CPU serving path (same contract as `oracle_attention`).

Where the C++ tiled kernel is built (float32, vLLM's interleaved pages on the
CPU, D_k == D_v, a compiled head dim), every row of the step, decode and
prefill, runs one tiled pass over its request's pages (`cpu_tiled.cpp`):
online softmax, running block maxima, Eq. 3 scores from the final statistics,
top-k over blocks, written straight into `indices`. Otherwise, in batched
PyTorch, one set of logits gives both the exact output and the block maxima,
so every key is scored once, and decode rows of all requests run together.
"""

import torch

from csrc_triton import cpu_ext
from csrc_triton.oracle.naive import top_blocks
from csrc_triton.paged_args import check_paged_batch, kv_scaled
from csrc_triton.paged_batch import BatchPlan, cpu_kernel_pages, oracle_attention_rows, plan_or_make


def select_blocks(z, lse, limit, sparse_block_size: int, topk: int):
    """The oracle's top-k blocks from a row's logits (SPEC §3.1, Eq. 3).

    Args:
        z: `[b, G, r, P, S]` logits, -inf past each row's position; lse: `[b, G, r, P, 1]`;
        limit: `[b, r]` each row's position.
    Returns:
        block ids `[b, r, G, topk]` (ascending, -1 padded).
    """
    b, g, r = z.shape[:3]
    s = z.shape[-1]
    num_blocks, full = -(-s // sparse_block_size), s // sparse_block_size
    u = z[..., :full * sparse_block_size].view(*z.shape[:-1], full, sparse_block_size).amax(dim=-1)
    if full < num_blocks:  # the partial last block, without padding a copy of z
        u = torch.cat([u, z[..., full * sparse_block_size:].amax(dim=-1, keepdim=True)], dim=-1)
    scores = torch.exp(u - lse).amax(dim=3)  # [b, G, r, NB]: S = exp(u - lse), max over the group's heads
    starts = torch.arange(num_blocks, device=z.device) * sparse_block_size
    visible = starts[None, None, :] <= limit[:, :, None]  # [b, r, NB]
    ids = top_blocks(scores.transpose(1, 2).reshape(b * r, g, num_blocks), visible.reshape(b * r, num_blocks), topk)
    return ids.view(b, r, g, topk)


NO_LOGITS = torch.empty(0)  # the kernel's logits / lse outputs, not asked for (the token oracle asks)


def tiled_kernel(q, k_cache, v_cache):
    """`(module, pages)` of the C++ tiled oracle for these inputs, or None where it does not apply."""
    base = cpu_kernel_pages(k_cache, v_cache)
    if base is None or q.dtype != torch.float32:
        return None
    ext = cpu_ext.load("oracle_tiled")
    if ext is None or q.shape[-1] not in ext.SUPPORTED_DIMS:
        return None
    return ext, base


def bind_oracle(q, k_cache, v_cache, *, sparse_block_size: int, topk: int, scale: float):
    """The C++ tiled oracle bound to one layer's pages, block size, top-k and scale; None where it does not apply
    (`tiled_kernel`). Returns `run(q [n, H, D], block_table, plan, out [n, H, Dv], indices [n, G, topk] int32,
    scores=None)` for the `n = plan.num_tokens` rows of a step, writing out and indices in place (scores: the
    tests' `[n, G, NB]` Eq. 3 scores, or None).
    The serving path binds it once per layer and cache (see `paged_batch.bind_sparse`).
    """
    tiled = tiled_kernel(q, k_cache, v_cache)
    if tiled is None:
        return None
    ext, pages = tiled
    no_scores = torch.zeros(0, k_cache.shape[1], 0)

    def run(q, block_table, plan, out, indices, scores=None):
        rows = q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous()
        o = out if out.is_contiguous() else torch.empty_like(out)
        ids = indices if indices.stride()[1:] == (topk, 1) else torch.empty_like(indices)
        ext.oracle_tiled(rows, pages, block_table, plan.row_req, plan.row_pos, sparse_block_size, topk, scale, o, ids,
                         no_scores if scores is None else scores, NO_LOGITS, NO_LOGITS)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)
        if ids.data_ptr() != indices.data_ptr():
            indices.copy_(ids)

    return run


@kv_scaled
def oracle_attention_batched(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *, scale,
                             sparse_block_size, topk, out=None, plan: BatchPlan | None = None,
                             indices: torch.Tensor | None = None, return_block_scores: bool = False):
    """`oracle_attention` on the CPU; `plan` (from `make_plan`) spares the host read of the batch layout.

    Args:
        indices: `[T, G, topk]` int32 to write the block ids into (e.g. the layer's index buffer), or None.
        return_block_scores: also return the Eq. 3 group scores `[T, G, NB]` (tests; C++ kernel only).
    Returns:
        out `[T, H, Dv]` and indices `[T, G, topk]` int32; rows past the last request get 0 and -1.
    """
    out, _ = check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)
    plan = plan_or_make(plan, query_start_loc, seq_lens, q.shape[0])
    shape = (q.shape[0], k_cache.shape[1], topk)
    if indices is None:
        indices = torch.empty(shape, dtype=torch.int32, device=q.device)
    assert indices.shape == shape and indices.dtype == torch.int32, f"indices: expected {list(shape)} int32"
    n = plan.num_tokens
    out[n:].zero_()
    indices[n:].fill_(-1)
    run = bind_oracle(q, k_cache, v_cache, sparse_block_size=sparse_block_size, topk=topk, scale=scale)
    if run is not None:
        num_scores = -(-int(seq_lens.max()) // sparse_block_size) if return_block_scores and n else 0
        scores = torch.zeros(q.shape[0] if num_scores else 0, k_cache.shape[1], num_scores)
        run(q[:n], block_table, plan, out[:n], indices[:n], scores[:n])
        return (out, indices, scores) if return_block_scores else (out, indices)
    assert not return_block_scores, "block scores are returned by the C++ tiled kernel only"

    def select(z, lse, limit):
        return select_blocks(z, lse, limit, sparse_block_size, topk)

    oracle_attention_rows(q, k_cache, v_cache, block_table, plan, out, indices, scale=scale, select=select)
    return out, indices
