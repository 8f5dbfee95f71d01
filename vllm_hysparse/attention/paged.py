# SPDX-License-Identifier: Apache-2.0
"""Paged-cache views and writes of the HySparse backend.

The batch layout (which rows belong to which request) lives in
`csrc_triton.paged_batch`, beside the kernels that use it.
"""

import torch


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical page view `[blocks, G, page, D_k + D_v]` -> key `[blocks, G, page, D_k]` and value
    `[blocks, G, page, D_v]` views; `head_size` is D_k (vLLM hands the impl the q/k head size).

    Any physical layout works: only views and strides are used.
    """
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store key `[T, G, D_k]` / value `[T, G, D_v]` at flat slots `block * page + offset`.

    Negative slots are padding rows. They are written to block 0, vLLM's null
    block, which no request reads, instead of being filtered out: a boolean
    filter would need the count of valid slots on the host.
    """
    n = slot_mapping.shape[0]
    slots = slot_mapping.long().clamp_min(0)
    page = key_cache.shape[2]
    blocks, offsets = slots // page, slots % page
    key_cache[blocks, :, offsets] = key[:n].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[:n].to(value_cache.dtype)
