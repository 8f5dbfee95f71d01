# SPDX-License-Identifier: Apache-2.0
"""Reference HySparse model (SPEC §2.1, §2.2, §3.1, §3.2) as a transformers model."""

import torch
from torch import nn

from vllm_hysparse.configs.hysparse import FULL, HySparseConfig
from vllm_hysparse.reference import ops
from vllm_hysparse.reference.layers import (
    RMSNorm,
    RotaryEmbedding,
    gate_logits,
    gate_proj,
    kv_from_cache,
    make_mlp,
    sinks,
    split_heads,
)
from vllm_hysparse.reference.modeling_base import ReferenceCausalLM, normed_outputs


class HySparseFullAttention(nn.Module):
    """Causal attention that also publishes its KV and oracle block ids to its sparse followers."""

    def __init__(self, config: HySparseConfig, layer_idx: int):
        super().__init__()
        h, g, d, bias = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.attention_bias
        dv = config.v_head_dim  # the scale stays head_dim ** -0.5: it normalises q . k (SPEC §2.6)
        self.layer_idx, self.config, self.scale = layer_idx, config, d**-0.5
        # The last full layer may have no sparse followers: then it emits nothing.
        self.has_followers = layer_idx in config.oracle_layer.values()
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, g * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, g * dv, bias=bias)
        self.o_proj = nn.Linear(h * dv, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, positions, rope, cache, shared, switches):
        d, dv = self.config.head_dim, self.config.v_head_dim
        q, k, v = split_heads(self.q_proj(x), d), split_heads(self.k_proj(x), d), split_heads(self.v_proj(x), dv)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions), rope(k, positions)
        k, v = kv_from_cache(cache, self.layer_idx, k, v)
        o = ops.dense_attention(q, k, v, self.scale)
        shared.clear()
        if self.has_followers:
            cfg = self.config
            shared.update(k=k, v=v, block_ids=ops.oracle_block_topk(
                q, k, self.scale, cfg.sparse_block_size, cfg.sparse_topk_blocks))
        return self.o_proj(o.flatten(2))


class HySparseSparseAttention(nn.Module):
    """Gated sum of block-sparse attention over the oracle layer's KV and a sink SWA branch."""

    def __init__(self, config: HySparseConfig, layer_idx: int):
        super().__init__()
        h, g, d, bias = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.attention_bias
        dv = config.v_head_dim
        self.layer_idx, self.config, self.scale = layer_idx, config, d**-0.5
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
        self.swa_k_proj = nn.Linear(config.hidden_size, g * d, bias=bias)
        self.swa_v_proj = nn.Linear(config.hidden_size, g * dv, bias=bias)
        self.o_proj = nn.Linear(h * dv, config.hidden_size, bias=False)
        self.sparse_gate_proj = gate_proj(config, config.hidden_size)
        self.swa_gate_proj = gate_proj(config, config.hidden_size)
        self.sparse_sinks = sinks(config)
        self.swa_sinks = sinks(config)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.swa_k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, positions, rope, cache, shared, switches):
        cfg, d = self.config, self.config.head_dim
        q, k_swa = split_heads(self.q_proj(x), d), split_heads(self.swa_k_proj(x), d)
        v_swa = split_heads(self.swa_v_proj(x), cfg.v_head_dim)
        if cfg.qk_norm:
            q, k_swa = self.q_norm(q), self.swa_k_norm(k_swa)
        q, k_swa = rope(q, positions), rope(k_swa, positions)
        k_swa, v_swa = kv_from_cache(cache, self.layer_idx, k_swa, v_swa)
        # Global branch: the oracle full layer's KV and indices, or (switch off)
        # this layer's own KV and an oracle computed from its own scores.
        k_glob, v_glob = (shared["k"], shared["v"]) if switches.kv_sharing else (k_swa, v_swa)
        block_ids = self._block_ids(shared, q, k_glob, switches)
        o = ops.sparse_layer_attention(
            q, k_glob, v_glob, block_ids,
            k_swa if switches.swa_branch else None, v_swa,
            gate_logits(self.sparse_gate_proj, x, cfg.num_attention_heads),
            gate_logits(self.swa_gate_proj, x, cfg.num_attention_heads),
            block_size=cfg.sparse_block_size, swa_window=cfg.swa_window, scale=self.scale,
            sink_sparse=self.sparse_sinks, sink_swa=self.swa_sinks)
        return self.o_proj(o.flatten(2))

    def _block_ids(self, shared, q, k, switches) -> torch.Tensor:
        """`[B, Tq, G, K]` block ids for the global branch over keys `k`."""
        cfg = self.config
        if not switches.sparse_selection:
            nb = -(-k.shape[1] // cfg.sparse_block_size)
            return torch.arange(nb, device=q.device).expand(q.shape[0], q.shape[1], k.shape[2], nb)
        if switches.kv_sharing:
            return shared["block_ids"]
        return ops.oracle_block_topk(q, k, self.scale, cfg.sparse_block_size, cfg.sparse_topk_blocks)


ATTENTION_TYPES = {FULL: HySparseFullAttention, "sparse_attention": HySparseSparseAttention}


class HySparseDecoderLayer(nn.Module):
    def __init__(self, config: HySparseConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ATTENTION_TYPES[config.layer_types[layer_idx]](config, layer_idx)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, positions, rope, cache, shared, switches):
        h = h + self.self_attn(self.input_layernorm(h), positions, rope, cache, shared, switches)
        return h + self.mlp(self.post_attention_layernorm(h))


class HySparseModel(nn.Module):
    def __init__(self, config: HySparseConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HySparseDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_parameters, config)

    def forward(self, h, positions, cache, rows, switches, output_hidden_states):
        """h `[B, T, hidden]` -> (final normed hidden `[B, R, hidden]` at `rows`, per-layer hiddens)."""
        # What the latest full layer publishes (k, v, block ids) for the sparse layers after it.
        shared: dict[str, torch.Tensor] = {}
        hiddens = [h] if output_hidden_states else None
        for layer in self.layers:
            h = layer(h, positions, self.rotary_emb, cache, shared, switches)
            if hiddens is not None:
                hiddens.append(h)
        return normed_outputs(self.norm, h, rows, hiddens)


class HySparseForCausalLM(ReferenceCausalLM):
    """Reference HySparse causal LM: exact SPEC §3 math with a KV cache and autograd."""

    config_class, model_class = HySparseConfig, HySparseModel
    _no_split_modules = ["HySparseDecoderLayer"]
