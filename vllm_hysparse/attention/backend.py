# SPDX-License-Identifier: Apache-2.0
"""HySparse attention backend: the roles of HySparse and HySparse2 layers in vLLM.

A full layer with sparse followers uses role `oracle`: it stores its K/V in
its paged cache, computes exact causal attention and writes, per query and KV
group, the oracle's top-k block ids (SPEC §3.1) into its index buffer. A sparse
layer's global branch uses role `block_sparse`: it owns no cache (vLLM KV
sharing binds it to the full layer's), reads that buffer and attends, with its
sink, over the selected blocks (SPEC §3.2). The SWA branch is a plain windowed
vLLM `Attention` with sinks and needs nothing from us.

The cache is vLLM's logical page view `[blocks, G, page, D_k + D_v]` (vLLM's
CPU kernel packs its own layer caches in a private format, so those cannot be
shared). Two kernel paths, chosen by device or by `VLLM_HYSPARSE_KERNELS`:
`triton` (the `csrc_triton` kernels, CUDA's default; on CPU they need
`TRITON_INTERPRET=1`) and `torch` (the reference math of
`vllm_hysparse.reference.ops` per request over keys gathered from the pages,
the CPU default). Both run inside vLLM's opaque attention op, so
`torch.compile` never traces their data-dependent loops.
"""

import os

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

from vllm_hysparse.attention.paged import (
    gather_request_kv,
    iter_chunks,
    iter_requests,
    row_positions,
    split_kv_cache,
    write_kv,
)
from vllm_hysparse.metrics import pages_touched, worker_stats
from vllm_hysparse.reference import ops

BACKEND_NAME = "HYSPARSE"
KERNELS_ENV = "VLLM_HYSPARSE_KERNELS"
KERNEL_PATHS = ("triton", "torch")
ROLES = ("oracle", "block_sparse", "kv_owner", "token_oracle", "token_sparse")


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
    """One step's batch layout: device tensors for the kernels, host copies where PyTorch loops over requests.

    KV writes get their slots from vLLM directly (`do_kv_cache_update`).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_pages]


class HySparseMetadataBuilder(AttentionMetadataBuilder[HySparseMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HySparseMetadata:
        m = common_attn_metadata
        return HySparseMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            query_start_loc_cpu=m.query_start_loc_cpu,
            seq_lens_cpu=m.seq_lens.cpu(),
            block_table=m.block_table_tensor,
        )


def kernel_path(device: torch.device) -> str:
    """`triton` or `torch`: `VLLM_HYSPARSE_KERNELS` if set, else Triton on CUDA and PyTorch elsewhere."""
    choice = os.environ.get(KERNELS_ENV)
    if choice is None:
        return "triton" if device.type == "cuda" else "torch"
    if choice not in KERNEL_PATHS:
        raise ValueError(f"{KERNELS_ENV}: must be one of {list(KERNEL_PATHS)} (got {choice!r})")
    return choice


@dataclass(frozen=True)
class BlockSelection:
    """HySparse: top-`topk` blocks of `block_size` positions per query and KV group (SPEC §3.1)."""

    block_size: int
    topk: int


@dataclass(frozen=True)
class TokenSelection:
    """HySparse2: recent `window` ∪ top-`topk` tokens per query and KV group (SPEC §3.3)."""

    topk: int
    window: int
    reduce: str


class HySparseAttentionImpl(AttentionImpl):
    """Attention with a HySparse role.

    Roles: `oracle` (HySparse full layer: output + block ids), `block_sparse`
    (HySparse sparse layer's global branch), `kv_owner` (HySparse2 bridged
    cache: only written, never attended), `token_oracle` (HySparse2 cross full
    layer: output + token positions), `token_sparse` (HySparse2 cross sparse).

    Extra args (from `Attention(**extra_impl_args)`):
        hysparse_role: one of the roles above.
        index_buffer: `[max_num_batched_tokens, G, width]` int32, written by an
            oracle role and read by the sparse roles that follow it.
        selection: `BlockSelection` or `TokenSelection` of the roles that need one.
        sinks: `[H]` float32 sink logits (sparse roles), or None.
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, *,
                 hysparse_role: str, index_buffer: torch.Tensor | None = None,
                 selection: BlockSelection | TokenSelection | None = None, sinks: torch.Tensor | None = None):
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
        self.selection = selection
        self.sinks = sinks
        self.kernels: str | None = None  # resolved on the first call, when the device is known

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
        if self.role == "kv_owner":
            raise RuntimeError("a HySparse2 bridged cache is written by the bridge op and never attended directly")
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        meta = attn_metadata
        if self.kernels is None:
            self.kernels = kernel_path(query.device)
        if self.kernels == "triton":
            self._forward_triton(query, key_cache, value_cache, meta, output)
            return output
        for rows in iter_requests(meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.num_actual_tokens):
            keys = gather_request_kv(key_cache, meta.block_table[rows.index], rows.seq_len)
            values = gather_request_kv(value_cache, meta.block_table[rows.index], rows.seq_len)
            for s, e, n_keys in iter_chunks(rows):
                q, k, v = query[s:e].unsqueeze(0), keys[:, :n_keys], values[:, :n_keys]
                output[s:e].copy_(self._attend(q, k, v, s, e, key_cache.shape[2])[0])
        return output

    def _attend(self, q, k, v, s: int, e: int, page_size: int) -> torch.Tensor:
        """Rows `[s, e)` of the batch: q `[1, n, H, D]` over k, v `[1, n_keys, G, D]` -> `[1, n, H, D]`."""
        sel, buf = self.selection, self.index_buffer
        positions = torch.arange(k.shape[1] - (e - s), k.shape[1])
        if self.role == "oracle":
            ids = ops.oracle_block_topk(q, k, self.scale, sel.block_size, sel.topk)
            self._publish(ids[0], s, positions, sel.block_size, page_size)
            return ops.dense_attention(q, k, v, self.scale)
        if self.role == "token_oracle":
            ids = ops.token_topk(q, k, self.scale, sel.topk, sel.window, sel.reduce)
            self._publish(ids[0], s, positions, 1, page_size)
            return ops.dense_attention(q, k, v, self.scale)
        ids = buf[s:e].unsqueeze(0).long()
        if self.role == "block_sparse":
            return ops.block_sparse_attention(q, k, v, ids, sel.block_size, self.scale, self.sinks)
        return ops.token_sparse_attention(q, k, v, ids, self.scale, self.sinks)

    def _publish(self, ids: torch.Tensor, start: int, positions: torch.Tensor, block_size: int,
                 page_size: int) -> None:
        """Hand `ids [n, G, width]` (rows from `start`) to the sparse followers and count their pages.

        Pages are counted where the ids live; only the sums cross to the host.
        """
        self.index_buffer[start:start + ids.shape[0]].copy_(ids)
        worker_stats().add(pages_touched(ids, positions, block_size, page_size), positions, page_size)

    def _forward_triton(self, query, key_cache, value_cache, meta: HySparseMetadata, output) -> None:
        """The whole batch in one launch of a `csrc_triton` kernel."""
        n = meta.num_actual_tokens
        batch = (query[:n], key_cache, value_cache, meta.block_table, meta.query_start_loc, meta.seq_lens)
        sel, buf = self.selection, self.index_buffer
        if self.role == "oracle":
            from csrc_triton.oracle import oracle_attention

            _, ids = oracle_attention(*batch, scale=self.scale, sparse_block_size=sel.block_size, topk=sel.topk,
                                      out=output[:n])
            positions = row_positions(meta.query_start_loc_cpu, meta.seq_lens_cpu, n).to(ids.device)
            self._publish(ids, 0, positions, sel.block_size, key_cache.shape[2])
        elif self.role == "token_oracle":
            from csrc_triton.token_oracle import token_oracle_attention

            _, ids = token_oracle_attention(*batch, scale=self.scale, topk_tokens=sel.topk, recent_window=sel.window,
                                            score_head_reduce=sel.reduce, out=output[:n])
            positions = row_positions(meta.query_start_loc_cpu, meta.seq_lens_cpu, n).to(ids.device)
            self._publish(ids, 0, positions, 1, key_cache.shape[2])
        elif self.role == "block_sparse":
            from csrc_triton.block_sparse import block_sparse_attention

            block_sparse_attention(*batch, buf[:n], scale=self.scale, sparse_block_size=sel.block_size,
                                   sinks=self.sinks, out=output[:n])
        else:
            from csrc_triton.token_sparse import token_sparse_attention

            token_sparse_attention(*batch, buf[:n], scale=self.scale, sinks=self.sinks, out=output[:n])
