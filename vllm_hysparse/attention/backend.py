# SPDX-License-Identifier: Apache-2.0
"""HySparse attention backend: the full layer's oracle role and the sparse layer's block-sparse role.

A full layer with sparse followers uses role `oracle`: it stores its K/V in
its paged cache, computes exact causal attention and writes, per query and KV
group, the oracle's top-k block ids (SPEC §3.1) into its index buffer. A sparse
layer's global branch uses role `block_sparse`: it owns no cache (vLLM KV
sharing binds it to the full layer's), reads that buffer and attends, with its
sink, over the selected blocks (SPEC §3.2). The SWA branch is a plain windowed
vLLM `Attention` with sinks and needs nothing from us.

The cache is vLLM's logical page view `[blocks, G, page, D_k + D_v]`, read and
written with PyTorch only (vLLM's CPU kernel packs its own layer caches in a
private format, so those cannot be shared). The per-request math is the
reference (`vllm_hysparse.reference.ops`) over keys gathered from the pages;
it runs inside vLLM's opaque attention op, so `torch.compile` never traces its
data-dependent loops.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from vllm_hysparse.attention.paged import gather_request_kv, iter_chunks, iter_requests, split_kv_cache, write_kv
from vllm_hysparse.metrics import pages_touched, worker_stats
from vllm_hysparse.reference import ops

BACKEND_NAME = "HYSPARSE"
ROLES = ("oracle", "block_sparse")


class HySparseAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["HySparseAttentionImpl"]:
        return HySparseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["HySparseMetadataBuilder"]:
        return HySparseMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class HySparseMetadata:
    """What the PyTorch path needs of one step; host tensors where it loops over requests."""

    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_pages]
    slot_mapping: torch.Tensor  # [num_tokens]


class HySparseMetadataBuilder(AttentionMetadataBuilder[HySparseMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HySparseMetadata:
        m = common_attn_metadata
        return HySparseMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc_cpu=m.query_start_loc_cpu,
            seq_lens_cpu=m.seq_lens.cpu(),
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )


class HySparseAttentionImpl(AttentionImpl):
    """Attention with a HySparse role (`oracle` or `block_sparse`).

    Extra args (from `Attention(**extra_impl_args)`):
        hysparse_role: `oracle` or `block_sparse`.
        index_buffer: `[max_num_batched_tokens, G, topk]` int32, written by the
            oracle layer and read by its block-sparse followers.
        sparse_block_size, sparse_topk_blocks: B and k of SPEC §2.1.
        sinks: `[H]` float32 sink logits (block-sparse branch), or None.
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, *,
                 hysparse_role: str, index_buffer: torch.Tensor, sparse_block_size: int, sparse_topk_blocks: int,
                 sinks: torch.Tensor | None = None):
        if hysparse_role not in ROLES:
            raise ValueError(f"hysparse_role: must be one of {ROLES} (got {hysparse_role!r})")
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise ValueError("the HySparse backend supports no ALiBi, sliding window or soft cap")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.role = hysparse_role
        self.index_buffer = index_buffer
        self.block_size = sparse_block_size
        self.topk = sparse_topk_blocks
        self.sinks = sinks

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """key, value `[T, G, D]` -> the layer's pages at `slot_mapping`."""
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        write_kv(key_cache, value_cache, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: HySparseMetadata | None, output,
                output_scale=None, output_block_scale=None):
        """query `[T, H, D]`, kv_cache `[blocks, G, page, 2*D]` -> `output [T, H, D]`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the HySparse backend")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        meta = attn_metadata
        for rows in iter_requests(meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.num_actual_tokens):
            keys = gather_request_kv(key_cache, meta.block_table[rows.index], rows.seq_len)
            values = gather_request_kv(value_cache, meta.block_table[rows.index], rows.seq_len)
            for s, e, n_keys in iter_chunks(rows):
                q, k, v = query[s:e].unsqueeze(0), keys[:, :n_keys], values[:, :n_keys]
                if self.role == "oracle":
                    output[s:e].copy_(ops.dense_attention(q, k, v, self.scale)[0])
                    ids = ops.oracle_block_topk(q, k, self.scale, self.block_size, self.topk)
                    self.index_buffer[s:e].copy_(ids[0])
                    self._record_pages(ids[0], n_keys, key_cache.shape[2])
                else:
                    ids = self.index_buffer[s:e].unsqueeze(0).long()
                    o = ops.block_sparse_attention(q, k, v, ids, self.block_size, self.scale, self.sinks)
                    output[s:e].copy_(o[0])
        return output

    def _record_pages(self, block_ids: torch.Tensor, n_keys: int, page_size: int) -> None:
        """Pages per query of the selection just made (what every sparse follower will read)."""
        positions = torch.arange(n_keys - block_ids.shape[0], n_keys)
        pages = pages_touched(block_ids.cpu(), positions, self.block_size, page_size)
        worker_stats().add(pages, positions, page_size)
