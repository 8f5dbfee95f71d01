# SPDX-License-Identifier: Apache-2.0
"""Inference-only HySparse model compatible with HySparse checkpoints (SPEC §2.1, §2.2, §3.1, §3.2).

Hybrid blocks of one full-attention layer and N sparse layers. The full layer
owns a full-length paged KV cache and writes, per query and KV group, the
oracle's top-k block ids into an index buffer. Each sparse layer owns **no**
full-length cache: its global branch shares the full layer's cache (vLLM KV
sharing) and reads that buffer; its SWA branch owns a window-bounded cache.
The two branches are mixed with sigmoid gates.

Follows vLLM's `vllm/model_executor/models/qwen3.py` (attention with optional
per-head q/k RMSNorm, pre-norm decoder layer, `make_layers` model with pipeline
stages, causal LM with a logits processor, here `causal_lm.HybridForCausalLM`). It differs in: the sparse layers'
two-branch attention (fused q / SWA-K/V projection, gates, sinks), the KV
sharing of sparse layers with their block's full layer, the MoE MLP
(`layers.SparseMoeBlock`, Qwen3-MoE style), and the strict loader
(`loader.load_checked`) in place of `AutoWeightsLoader`.
"""


import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
)
from vllm.sequence import IntermediateTensors

from vllm_hysparse.attention.backend import BlockSelection, HySparseAttentionBackend
from vllm_hysparse.configs import HySparseConfig
from vllm_hysparse.configs.tensors import layer_kind
from vllm_hysparse.models.causal_lm import HybridForCausalLM
from vllm_hysparse.models.layers import (
    PreNormDecoderLayer,
    gate_width,
    make_sinks,
    maybe_head_norm,
    plain_full_attention,
    project_qkv,
    qkv_and_out,
    separate_v,
    window_attention,
)
from vllm_hysparse.models.loader import QKV_STACK
from vllm_hysparse.models.tp_heads import HeadSplit
from vllm_hysparse.vllm_glue.forward_context import run_attention_op

# HF module under `self_attn.` -> (vLLM parameter owner, shard id) of the fused projections.
STACKS = {
    "full": QKV_STACK,
    "sparse": {
        "q_proj": ("model.layers.{i}.self_attn.q_swa_kv_proj", "q"),
        "swa_k_proj": ("model.layers.{i}.self_attn.q_swa_kv_proj", "k"),
        "swa_v_proj": ("model.layers.{i}.self_attn.q_swa_kv_proj", "v"),
        "sparse_gate_proj": ("model.layers.{i}.self_attn.gate_proj", 0),
        "swa_gate_proj": ("model.layers.{i}.self_attn.gate_proj", 1),
    },
}


def attn_layer_name(layer_idx: int) -> str:
    """Name of the KV-owning `Attention` of full layer `layer_idx` (the KV-sharing target)."""
    return f"model.layers.{layer_idx}.self_attn.attn"


class HySparseFullAttention(nn.Module):
    """Causal attention over the layer's own cache; emits oracle block ids for its sparse followers."""

    def __init__(self, config: HySparseConfig, cache_config, index_buffer: torch.Tensor | None, prefix: str,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.heads = HeadSplit(config)
        self.qkv_proj, self.o_proj = qkv_and_out(config, prefix, quant_config)
        self.q_norm, self.k_norm = maybe_head_norm(config), maybe_head_norm(config)
        self.rotary_emb = get_rope(config.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        # The last full layer may have no sparse followers: then it is plain attention.
        self.oracle = index_buffer is not None
        oracle_args = plain_full_attention(config, cache_config) if not self.oracle else dict(
            attn_backend=HySparseAttentionBackend, hysparse_role="oracle", index_buffer=index_buffer,
            selection=BlockSelection(config.sparse_block_size, config.sparse_topk_blocks), **separate_v(config))
        # An oracle runs its whole KV group's query heads (see `HeadSplit.group_query`).
        num_heads = self.heads.oracle_heads if self.oracle else self.heads.num_heads
        self.attn = Attention(num_heads, config.head_dim, config.head_dim**-0.5,
                              num_kv_heads=self.heads.num_kv_heads, cache_config=cache_config,
                              prefix=f"{prefix}.attn", **oracle_args)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.heads
        q, k, v = project_qkv(self.qkv_proj, h, hidden_states, self.q_norm, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        if self.oracle:
            out, _ = self.o_proj(h.own_heads(self.attn(h.group_query(q), k, v)))
        else:
            out, _ = self.o_proj(self.attn(q, k, v))
        return out


class HySparseSparseAttention(nn.Module):
    """Gated sum of block-sparse attention over the oracle layer's cache and a sink SWA branch."""

    def __init__(self, config: HySparseConfig, cache_config, index_buffer: torch.Tensor, oracle_layer: int,
                 prefix: str, quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.heads = h = HeadSplit(config)
        # q_proj, swa_k_proj and swa_v_proj are fused like a full layer's q/k/v. Not named
        # `qkv_proj`: vLLM maps a fused module to its shards by name alone (packed_modules_mapping).
        self.q_swa_kv_proj, self.o_proj = qkv_and_out(config, prefix, quant_config, qkv_name="q_swa_kv_proj")
        width = gate_width(config)
        self.gate_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2, bias=False,
                                                    quant_config=quant_config, prefix=f"{prefix}.gate_proj")
        self.q_norm, self.swa_k_norm = maybe_head_norm(config), maybe_head_norm(config)
        self.sparse_sinks, self.swa_sinks = make_sinks(config, h), make_sinks(config, h)
        self.rotary_emb = get_rope(config.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        common = dict(num_kv_heads=h.num_kv_heads, cache_config=cache_config)
        scale = config.head_dim**-0.5
        self.attn = Attention(
            h.num_heads, config.head_dim, scale, prefix=f"{prefix}.attn",
            kv_sharing_target_layer_name=attn_layer_name(oracle_layer),
            attn_backend=HySparseAttentionBackend, hysparse_role="block_sparse", index_buffer=index_buffer,
            selection=BlockSelection(config.sparse_block_size, config.sparse_topk_blocks),
            sinks=self.sparse_sinks, fused_window=f"{prefix}.swa_attn", gate_width=width // config.num_attention_heads,
            **separate_v(config), **common)
        # Owns the window cache; its op never runs: `attn`'s op writes and attends it too (one op, not two).
        self.swa_attn = Attention(h.num_heads, config.head_dim, scale, prefix=f"{prefix}.swa_attn",
                                  **window_attention(config, self.swa_sinks, cache_config), **common)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.heads
        q, k, v = project_qkv(self.q_swa_kv_proj, h, hidden_states, self.q_norm, self.swa_k_norm)
        q, k = self.rotary_emb(positions, q, k)
        gates, _ = self.gate_proj(hidden_states)
        # Both branches in one attention op (`fused_window`), which stores sigmoid(g_sparse) * global +
        # sigmoid(g_swa) * window (`gate_width`): its output buffer carries the gates in, then that sum.
        t = q.shape[0]
        output = torch.cat([gates.to(q.dtype).reshape(-1), q.new_empty(t * h.num_heads * h.head_dim_v)])
        run_attention_op(self.attn, q, k, v, output)
        out, _ = self.o_proj(output[gates.numel():].view(t, -1).to(hidden_states.dtype))
        return out


def make_decoder_layer(config: HySparseConfig, cache_config, index_buffers: dict[int, torch.Tensor],
                       prefix: str, quant_config: QuantizationConfig | None = None) -> PreNormDecoderLayer:
    idx = extract_layer_index(prefix)
    if layer_kind(config, idx) == "full":
        attn = HySparseFullAttention(config, cache_config, index_buffers.get(idx), f"{prefix}.self_attn",
                                     quant_config)
    else:
        oracle = config.oracle_layer[idx]
        attn = HySparseSparseAttention(config, cache_config, index_buffers[oracle], oracle, f"{prefix}.self_attn",
                                       quant_config)
    return PreNormDecoderLayer(config, attn, prefix, quant_config)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class HySparseModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: HySparseConfig = vllm_config.model_config.hf_config
        self.config = config
        heads = HeadSplit(config)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        pp = get_pp_group()
        # This pipeline stage's layers; the config hook has checked that no block straddles stages.
        start, end = get_pp_indices(config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        # One index buffer per full layer of this stage with followers: [tokens, G, topk] block ids.
        # Registered (non-persistent) so they live on the model's device; the attention layers hold references.
        self.index_buffers = {}
        for f in sorted(f for f in set(config.oracle_layer.values()) if start <= f < end):
            self.register_buffer(f"index_buffer_{f}", torch.full(
                (max_tokens, heads.num_kv_heads, config.sparse_topk_blocks), -1, dtype=torch.int32), persistent=False)
            self.index_buffers[f] = getattr(self, f"index_buffer_{f}")
        quant_config = vllm_config.quant_config
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                    prefix=f"{prefix}.embed_tokens")
                             if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank)
                             else PPMissingLayer())
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: make_decoder_layer(config, vllm_config.cache_config, self.index_buffers, prefix,
                                              quant_config),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """`[T]` ids (first stage) or the previous stage's `[T, hidden]` stream -> last stage's normed `[T, hidden]`."""
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class HySparseForCausalLM(HybridForCausalLM, SupportsLoRA):
    config_class, model_class, stacks = HySparseConfig, HySparseModel, STACKS
    # Fused vLLM module -> the checkpoint modules it stacks (quantization ignore lists, LoRA).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "q_swa_kv_proj": ["q_proj", "swa_k_proj", "swa_v_proj"],
        "gate_proj": ["sparse_gate_proj", "swa_gate_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
