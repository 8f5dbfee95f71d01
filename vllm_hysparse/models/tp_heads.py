# SPDX-License-Identifier: Apache-2.0
"""How a layer's heads split over tensor-parallel ranks (`HeadSplit`): per-rank head counts, the q/k and v widths,
and the gathers an oracle layer needs when a KV group spans several ranks."""

import torch
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)

from vllm_hysparse.configs.base import HySparseBaseConfig, tensor_parallel_heads


class HeadSplit:
    """Per-rank head counts under tensor parallelism, and the q/k (`head_dim`) and v (`head_dim_v`) widths.

    KV heads are split over the ranks like vLLM's `QKVParallelLinear` splits
    them: `G / tp` per rank when `tp` divides `G`, else (`tp` a multiple of
    `G`) one per rank, KV head `rank // (tp / G)`, replicated on `tp / G`
    ranks. Query heads are always split (`H / tp` per rank, in order), so a
    rank's query heads all belong to its KV heads; with replicated KV heads a
    KV group's `H / G` query heads are spread over `tp / G` ranks
    (`groups_split`), which the oracle layers must undo (`group_query`).
    """

    def __init__(self, config: HySparseBaseConfig, tp: int | None = None, rank: int | None = None):
        tp = get_tensor_model_parallel_world_size() if tp is None else tp
        rank = get_tensor_model_parallel_rank() if rank is None else rank
        h, g = config.num_attention_heads, config.num_key_value_heads
        self.tp, self.rank = tp, rank
        self.num_heads, self.num_kv_heads = tensor_parallel_heads(config, tp)
        self.head_dim, self.head_dim_v = config.head_dim, config.v_head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.v_size = self.num_kv_heads * self.head_dim_v
        self.total_kv_heads, self.group_heads = g, h // g
        self.groups_split = tp > g
        replicas = tp // g if self.groups_split else 1
        self.kv_head = rank // replicas if self.groups_split else rank * self.num_kv_heads  # this rank's first
        # This rank's first query head within its KV group (0 unless the group is split).
        self.group_offset = (rank % replicas) * self.num_heads

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused `[T, q + k + v]` projection output -> q `[T, H*D]`, k `[T, G*D]`, v `[T, G*Dv]`."""
        return qkv.split([self.q_size, self.kv_size, self.v_size], dim=-1)

    @property
    def oracle_heads(self) -> int:
        """Query heads an oracle layer's `Attention` runs: its whole KV group's when the group is split."""
        return self.group_heads if self.groups_split else self.num_heads

    def group_query(self, q: torch.Tensor) -> torch.Tensor:
        """Query of an oracle layer: `[T, H/tp * D]` -> `[T, oracle_heads * D]` (the rank's KV group's heads).

        The oracle reduces scores over every query head of a KV group (SPEC
        §3.1, §3.3), so with a split group each rank gathers the whole
        group's queries and makes the group's selection, the same on every
        rank that holds the group. This costs each rank `tp / G` times the
        layer's attention (the group's heads instead of its own). A cheaper
        exact alternative, not built: all-reduce (max / sum) the per-block or
        per-token group scores across the group's ranks inside the kernels,
        before their top-k.
        """
        if not self.groups_split:
            return q
        return self.group_of(tensor_model_parallel_all_gather(q.contiguous(), dim=-1))

    def group_of(self, q_all: torch.Tensor) -> torch.Tensor:
        """All ranks' queries `[T, H*D]` (rank order) -> this rank's KV group's `[T, H/G * D]`."""
        width = self.group_heads * self.head_dim
        return q_all[:, self.kv_head * width:(self.kv_head + 1) * width].contiguous()

    def own_heads(self, o: torch.Tensor) -> torch.Tensor:
        """Oracle output `[T, oracle_heads * Dv]` -> this rank's heads `[T, H/tp * Dv]`."""
        if not self.groups_split:
            return o
        first, dv = self.group_offset, self.head_dim_v
        return o[:, first * dv:(first + self.num_heads) * dv].contiguous()

    def own_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A bridge's K/V `[T, G_kv*D + G_kv*Dv]` (`kv_parallel` layout) -> this rank's k `[T, G*D]`, v `[T, G*Dv]`.

        With replicated KV heads the projection holds all `G` heads (see
        `kv_parallel`) and the rank keeps its own; otherwise it already is the rank's.
        """
        if not self.groups_split:
            return kv.split([self.kv_size, self.v_size], dim=-1)
        g, d, dv, i = self.total_kv_heads, self.head_dim, self.head_dim_v, self.kv_head
        return kv[:, i * d:(i + 1) * d].contiguous(), kv[:, g * d + i * dv:g * d + (i + 1) * dv]

    def kv_parallel(self) -> dict:
        """Keywords of a K/V-only `MergedColumnParallelLinear` `[G*D, G*Dv]`: replicated when KV heads are.

        Column parallelism would cut one KV head across ranks; a replicated
        projection costs a rank all `G` heads (with MQA, `G = 1`, nothing extra)
        and keeps the checkpoint's tensors and their loading unchanged.
        """
        return {"disable_tp": True} if self.groups_split else {}
