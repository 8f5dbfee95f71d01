# SPDX-License-Identifier: Apache-2.0
"""Argument checks every paged-attention launcher shares (no Triton import: cheap and testable on CPU).

Also the FP8 KV-cache contract of every entry point (`kv_scaled`).
"""

import functools

import torch

# vLLM's `kv_cache_dtype="fp8"` / `"fp8_e4m3"`: e4m3 values `x / scale`, one float scale per layer for K and one
# for V (vLLM's `Attention._k_scale` / `_v_scale`, 1.0 unless a checkpoint gives them).
FP8_KV_DTYPE = torch.float8_e4m3fn


def check_paged_batch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out,
                      sinks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shape, dtype and device checks of a vLLM paged batch; returns `(out, sinks)` ready to launch.

    Args:
        q: `[T, H, D]` fp16 / bf16 / fp32 (D: the q/k head dim).
        k_cache: `[num_pages, G, page_size, D]`, v_cache: `[num_pages, G, page_size, Dv]`, in q's dtype
            or both float8_e4m3fn (an FP8 KV cache, see `kv_scaled`), any strides. Dv (the value head dim,
            SPEC §2.6) may differ from D; outputs are Dv wide.
        block_table: `[R, max_pages]` int32 with contiguous rows.
        query_start_loc: `[R + 1]` int32; seq_lens: `[R]` int32.
        out: `[T, H, Dv]` in q's dtype, or None to allocate it.
        sinks: `[H]` sink logits (converted to float32), or None.
    """
    assert q.dim() == 3, f"q: expected [T, H, D], got {tuple(q.shape)}"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q: unsupported dtype {q.dtype}"
    assert k_cache.dim() == 4 and v_cache.dim() == 4 and k_cache.shape[:3] == v_cache.shape[:3], \
        f"k_cache/v_cache: expected [num_pages, G, page_size, D] / [num_pages, G, page_size, Dv], got " \
        f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, FP8_KV_DTYPE), \
        f"k_cache/v_cache must both have q's dtype {q.dtype} or {FP8_KV_DTYPE} (got {k_cache.dtype} / {v_cache.dtype})"
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    assert k_cache.shape[3] == head_dim, f"head dim: q has {head_dim}, the cache {k_cache.shape[3]}"
    head_dim_v = v_cache.shape[3]
    assert 16 <= head_dim <= 256, f"head dim {head_dim} not supported (16..256)"
    assert 16 <= head_dim_v <= 256, f"value head dim {head_dim_v} not supported (16..256)"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads cannot share {num_kv_heads} KV groups"
    assert block_table.dim() == 2 and block_table.dtype == torch.int32, "block_table: expected [R, max_pages] int32"
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    num_reqs = seq_lens.shape[0]
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, "seq_lens: expected [R] int32"
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32, \
        f"query_start_loc: expected [{num_reqs + 1}] int32"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous(), "query_start_loc/seq_lens must be contiguous"
    assert block_table.shape[0] >= num_reqs, f"block_table has {block_table.shape[0]} rows for {num_reqs} requests"
    if sinks is not None:
        assert sinks.shape == (num_heads,), f"sinks: expected [{num_heads}], got {tuple(sinks.shape)}"
        sinks = sinks.to(torch.float32).contiguous()
    out_shape = (q.shape[0], num_heads, head_dim_v)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    assert out.shape == out_shape and out.dtype == q.dtype, f"out: expected {list(out_shape)} in q's dtype"
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "block_table": block_table, "query_start_loc": query_start_loc,
               "seq_lens": seq_lens, "sinks": sinks, "out": out}
    for name, x in tensors.items():
        assert x is None or x.device == q.device, f"{name} is on {x.device}, q on {q.device}"
    return out, sinks


def kv_scaled(entry):
    """Give a paged-attention entry point `k_scale` / `v_scale` keywords: the scales of an FP8 KV cache.

    The cache holds `K / k_scale` and `V / v_scale` (float8_e4m3fn, or q's dtype with scales 1.0); the
    result is attention over the dequantised K and V. The kernels load the stored values and widen them
    (exact: e4m3 fits in fp16 / bf16 / fp32); the scales are applied where they cost least. Every logit
    `scale * q . (k_scale * k)` is `(scale * k_scale) * q . k`, so `k_scale` joins the logit scale (and the
    oracles' selections, which rank those logits, stay exact). The output is linear in V (softmax weights,
    a sink only adds to their denominator), so `v_scale` multiplies the output once, in place.
    `entry` returns `out` or a tuple whose first item is `out`. An entry that stores its rows through a `gate`
    (a sparse layer's branch) gates the attention, not what `out` held: with a `v_scale`, its plain rows are
    scaled and then gated by `paged_batch.gated_store`.
    """

    @functools.wraps(entry)
    def scaled(*args, scale, k_scale: float = 1.0, v_scale: float = 1.0, **kwargs):
        if v_scale != 1.0 and kwargs.get("gate") is not None:
            from csrc_triton.paged_batch import gated_store  # it imports this module

            gate, accumulate, out = kwargs.pop("gate"), kwargs.pop("accumulate", False), kwargs.pop("out", None)
            assert out is not None or not accumulate, "accumulate: needs an out to add to"
            rows = entry(*args, scale=scale * k_scale, **kwargs).mul_(v_scale)
            return gated_store(torch.empty_like(rows) if out is None else out, rows, gate, accumulate)
        result = entry(*args, scale=scale * k_scale, **kwargs)
        if v_scale != 1.0:
            (result[0] if isinstance(result, tuple) else result).mul_(v_scale)
        return result

    return scaled
