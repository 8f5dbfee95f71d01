# SPDX-License-Identifier: Apache-2.0
"""Paged-cache views and writes of the HySparse backend.

The batch layout (which rows belong to which request) lives in
`csrc_triton.paged_batch`, beside the kernels that use it.
"""

from collections.abc import Callable

import torch

from csrc_triton import cpu_ext
from csrc_triton.paged_args import FP8_KV_DTYPE
from csrc_triton.paged_batch import cpu_kernel_pages

# The largest finite float8_e4m3fn value: writes saturate there, as vLLM's own FP8 cache writes do.
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical page view `[blocks, G, page, D_k + D_v]` -> key `[blocks, G, page, D_k]` and value
    `[blocks, G, page, D_v]` views; `head_size` is D_k (vLLM hands the impl the q/k head size).

    Any physical layout works: only views and strides are used. vLLM allocates an FP8 cache
    (`kv_cache_dtype="fp8"` / `"fp8_e4m3"`) as uint8; it is viewed as float8_e4m3fn.
    """
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(FP8_KV_DTYPE)
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x` as stored in a cache of `dtype`: itself, or for FP8 `x / scale` saturated to e4m3's range."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store key `[T, G, D_k]` / value `[T, G, D_v]` at flat slots `block * page + offset` (slot_mapping `[n]`,
    n <= T; negative slots are padding rows). See `bind_write_kv`."""
    bind_write_kv(key_cache, value_cache)(key, value, slot_mapping, k_scale, v_scale)


def bind_write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor) -> Callable:
    """`write_kv` bound to one layer's cache: `write(key, value, slot_mapping, k_scale=1.0, v_scale=1.0)`.

    One C++ call where the CPU kernels read the pages (float32, vLLM's interleaved
    pages, D_k == D_v), which skips the padding rows; elsewhere `write_kv_torch`.
    Bound once per layer and cache by the serving path: finding the pages costs
    several times the C++ write of a decode row (20 µs against 4, 2-core AMD EPYC).
    """
    pages = cpu_kernel_pages(key_cache, value_cache)
    ext = cpu_ext.load("sparse") if pages is not None else None

    def write(key, value, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        if ext is not None and key.dtype == value.dtype == torch.float32:
            ext.write_pages(pages, key, value, slot_mapping.long())
        else:
            write_kv_torch(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)

    return write


def write_kv_torch(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`write_kv` in PyTorch, any cache dtype and layout.

    An FP8 cache stores `key / k_scale` and `value / v_scale` (`to_cache`).

    Negative slots are padding rows. They are written to block 0, vLLM's null
    block, which no request reads, instead of being filtered out: a boolean
    filter would need the count of valid slots on the host.
    """
    n = slot_mapping.shape[0]
    slots = slot_mapping.long().clamp_min(0)
    page = key_cache.shape[2]
    blocks, offsets = slots // page, slots % page
    key_cache[blocks, :, offsets] = to_cache(key[:n], key_cache.dtype, k_scale)
    value_cache[blocks, :, offsets] = to_cache(value[:n], value_cache.dtype, v_scale)
