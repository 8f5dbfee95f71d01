# SPDX-License-Identifier: Apache-2.0
"""Reference HySparse2 model (SPEC §2.3, §2.4, §3.3) as a transformers model.

Self-decoder: full and sliding layers, each owning KV. Cross-decoder: full
layers whose K/V are *bridged* (projected from the residual stream entering a
self-decoder full layer) and sparse layers that attend, with one sink softmax,
over the recent window and the top-k tokens chosen by the cross full layer
before them. Because no cross-decoder KV depends on cross-decoder states, the
cross-decoder can run on the logits rows only (prefill early exit).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_hysparse.configs.hysparse2 import SLIDING, SPARSE, HySparse2Config
from vllm_hysparse.reference import ops
from vllm_hysparse.reference.layers import (
    ReferenceSwitches,
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


@dataclass
class StepContext:
    """What one forward pass hands to every layer."""

    cache: object
    switches: ReferenceSwitches
    full_rope: RotaryEmbedding | None  # None = NoPE on full and sparse layers
    swa_rope: RotaryEmbedding
    bridged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # What the latest cross full layer publishes (k, v, token ids) for its sparse followers.
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x if self.full_rope is None else self.full_rope(x, positions)


def _qkv_layer(module: nn.Module, config: HySparse2Config, with_kv: bool) -> None:
    h, g, d, bias = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.attention_bias
    dv = config.v_head_dim  # V, o_proj's input and the gates; q/k stay head_dim (SPEC §2.6)
    module.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
    module.o_proj = nn.Linear(h * dv, config.hidden_size, bias=False)
    if with_kv:
        module.k_proj = nn.Linear(config.hidden_size, g * d, bias=bias)
        module.v_proj = nn.Linear(config.hidden_size, g * dv, bias=bias)
    if config.qk_norm:
        module.q_norm = RMSNorm(d, config.rms_norm_eps)
        if with_kv:
            module.k_norm = RMSNorm(d, config.rms_norm_eps)


class _Attention(nn.Module):
    def __init__(self, config: HySparse2Config, layer_idx: int, with_kv: bool):
        super().__init__()
        self.config, self.layer_idx, self.scale = config, layer_idx, config.head_dim**-0.5
        _qkv_layer(self, config, with_kv)

    def query(self, x):
        q = split_heads(self.q_proj(x), self.config.head_dim)
        return self.q_norm(q) if self.config.qk_norm else q

    def project_kv(self, x):
        k, v = split_heads(self.k_proj(x), self.config.head_dim), split_heads(self.v_proj(x), self.config.v_head_dim)
        return (self.k_norm(k) if self.config.qk_norm else k), v


class SelfFullAttention(_Attention):
    """Causal attention owning its KV; RoPE only with `full_rope`."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, with_kv=True)

    def forward(self, x, positions, ctx: StepContext):
        k, v = self.project_kv(x)
        q, k = ctx.rope(self.query(x), positions), ctx.rope(k, positions)
        k, v = kv_from_cache(ctx.cache, self.layer_idx, k, v)
        return self.o_proj(ops.dense_attention(q, k, v, self.scale, positions=positions).flatten(2))


class SlidingAttention(_Attention):
    """Window attention with partial RoPE, a sink and a sigmoid output gate."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, with_kv=True)
        self.gate_proj = gate_proj(config, config.hidden_size)
        self.sinks = sinks(config)

    def forward(self, x, positions, ctx: StepContext):
        k, v = self.project_kv(x)
        q, k = ctx.swa_rope(self.query(x), positions), ctx.swa_rope(k, positions)
        k, v = kv_from_cache(ctx.cache, self.layer_idx, k, v)
        # Switch off: the whole causal context; RoPE, sink and gate stay as they are.
        window = self.config.swa_window if ctx.switches.sliding_window else None
        o = ops.dense_attention(q, k, v, self.scale, self.sinks, window=window, positions=positions)
        gate = torch.sigmoid(gate_logits(self.gate_proj, x, self.config.num_attention_heads).float())
        return self.o_proj((gate * o.float()).to(x.dtype).flatten(2))


class CrossFullAttention(_Attention):
    """Attention over bridged K/V; publishes the token selection to its sparse followers."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, with_kv=True)
        self.bridge_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.has_followers = layer_idx in config.oracle_layer.values()

    def bridge_kv(self, h_src, positions, ctx: StepContext):
        """K `[B, T, G, D]` and V `[B, T, G, Dv]` from the residual stream `h_src` entering the bridge source."""
        k, v = self.project_kv(self.bridge_norm(h_src))
        return ctx.rope(k, positions), v

    def forward(self, x, positions, ctx: StepContext):
        if ctx.switches.bridge:
            k, v = ctx.bridged[self.layer_idx]
        else:
            # Switch off: K/V from this layer's own normalised input (all rows run).
            k, v = self.project_kv(x)
            k, v = kv_from_cache(ctx.cache, self.layer_idx, ctx.rope(k, positions), v)
        q = ctx.rope(self.query(x), positions)
        o = ops.dense_attention(q, k, v, self.scale, positions=positions)
        ctx.shared.clear()
        if self.has_followers:
            ctx.shared.update(k=k, v=v, token_ids=self._select(q, k, positions, ctx.switches))
        return self.o_proj(o.flatten(2))

    def _select(self, q, k, positions, switches) -> torch.Tensor:
        cfg = self.config
        if not switches.token_selection:
            # Every key; causality is applied by the attention mask.
            return torch.arange(k.shape[1], device=q.device).expand(q.shape[0], q.shape[1], k.shape[2], -1)
        return ops.token_topk(
            q, k, self.scale, cfg.sparse_topk_tokens, cfg.recent_window, cfg.score_head_reduce,
            forced_window=switches.forced_window, positions=positions)


@dataclass
class OwnKV:
    """K/V projections of a cross sparse layer that has none: validation only.

    Held in a plain dataclass, outside the module tree, so they are never
    saved, loaded, moved or trained with the model.
    """

    k_proj: nn.Linear
    v_proj: nn.Linear
    k_norm: RMSNorm | None


class CrossSparseAttention(_Attention):
    """One sink softmax over the recent window and selected tokens of the cross full layer's cache."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, with_kv=False)
        self.gate_proj = gate_proj(config, config.hidden_size)
        self.sinks = sinks(config)
        self.own_kv: OwnKV | None = None

    def set_own_kv(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Give this layer K/V projections of its own, for the switch `cross_kv_sharing=False`; None removes them.

        A HySparse2 checkpoint has none (SPEC §2.4). `tensors` are named as in a
        dense layer's `self_attn`: `k_proj.weight`, `v_proj.weight`, with
        `attention_bias` `k_proj.bias` and `v_proj.bias`, with `qk_norm`
        `k_norm.weight` — the validator passes the dense teacher's layer of the
        same index, the one this layer was converted from.
        """
        if tensors is None:
            self.own_kv = None
            return
        cfg, g = self.config, self.config.num_key_value_heads
        holder = nn.Module()
        holder.k_proj = nn.Linear(cfg.hidden_size, g * cfg.head_dim, bias=cfg.attention_bias)
        holder.v_proj = nn.Linear(cfg.hidden_size, g * cfg.v_head_dim, bias=cfg.attention_bias)
        if cfg.qk_norm:
            holder.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        try:
            holder.load_state_dict(dict(tensors), strict=True)
        except RuntimeError as e:
            reason = " ".join(line.strip() for line in str(e).splitlines()[1:])
            raise ValueError(f"layer {self.layer_idx}: own K/V tensors do not fit: {reason}") from None
        holder.to(self.q_proj.weight)
        self.own_kv = OwnKV(holder.k_proj, holder.v_proj, getattr(holder, "k_norm", None))

    def project_own_kv(self, x, positions, ctx: StepContext):
        """K `[B, T, G, D]` (rotated like the cross full layer's) and V `[B, T, G, Dv]` from this layer's input `x`."""
        if self.own_kv is None:
            raise ValueError(f"cross_kv_sharing=False: cross sparse layer {self.layer_idx} has no K/V projections "
                             "of its own; give them with set_own_kv (the validator takes the teacher's)")
        kv = self.own_kv
        k, v = split_heads(kv.k_proj(x), self.config.head_dim), split_heads(kv.v_proj(x), self.config.v_head_dim)
        if kv.k_norm is not None:
            k = kv.k_norm(k)
        return ctx.rope(k, positions), v

    def keys_values(self, x, positions, ctx: StepContext):
        """K `[B, Tk, G, D]` / V `[B, Tk, G, Dv]` this layer attends over: the cross full layer's cache, or its own."""
        if ctx.switches.cross_kv_sharing:
            return ctx.shared["k"], ctx.shared["v"]
        return kv_from_cache(ctx.cache, self.layer_idx, *self.project_own_kv(x, positions, ctx))

    def forward(self, x, positions, ctx: StepContext):
        q = ctx.rope(self.query(x), positions)
        k, v = self.keys_values(x, positions, ctx)
        # The token ids are positions, so the cross full layer's selection applies to own K/V too.
        o = ops.token_sparse_attention(q, k, v, ctx.shared["token_ids"], self.scale, self.sinks, positions)
        gate = torch.sigmoid(gate_logits(self.gate_proj, x, self.config.num_attention_heads).float())
        return self.o_proj((gate * o.float()).to(x.dtype).flatten(2))


def attention_type(config: HySparse2Config, layer_idx: int) -> type[nn.Module]:
    kind, is_self = config.layer_types[layer_idx], layer_idx < config.num_self_decoder_layers
    if kind == SLIDING:
        return SlidingAttention
    if kind == SPARSE:
        return CrossSparseAttention
    return SelfFullAttention if is_self else CrossFullAttention


class HySparse2DecoderLayer(nn.Module):
    def __init__(self, config: HySparse2Config, layer_idx: int):
        super().__init__()
        self.self_attn = attention_type(config, layer_idx)(config, layer_idx)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, positions, ctx: StepContext):
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class HySparse2Model(nn.Module):
    def __init__(self, config: HySparse2Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HySparse2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.swa_rotary_emb = RotaryEmbedding(
            config.swa_rotary_dim, {"rope_type": "default", "rope_theta": config.swa_rope_theta})
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_parameters, config) if config.full_rope else None

    def forward(self, h, positions, cache, rows, switches, output_hidden_states):
        """h `[B, T, hidden]` -> (final normed hidden `[B, R, hidden]` at `rows`, per-layer hiddens).

        With early exit the cross-decoder runs on `rows` only; the result is
        identical to running it on every row (SPEC §3.3). It needs every
        cross-decoder K/V to come from the self-decoder: without `bridge` or
        `cross_kv_sharing` every row runs.
        """
        cfg = self.config
        ctx = StepContext(cache, switches, self.rotary_emb, self.swa_rotary_emb)
        hiddens = [h] if output_hidden_states else None
        sources = {}
        for layer in self.layers[: cfg.num_self_decoder_layers]:
            if layer.self_attn.layer_idx in cfg.bridge_sources:
                sources[layer.self_attn.layer_idx] = h
            h = layer(h, positions, ctx)
            if hiddens is not None:
                hiddens.append(h)
        if switches.bridge:
            for c, src in cfg.bridge_source.items():
                k, v = self.layers[c].self_attn.bridge_kv(sources[src], positions, ctx)
                ctx.bridged[c] = kv_from_cache(cache, c, k, v)
        if switches.bridge and switches.cross_kv_sharing and switches.early_exit:
            h, positions, rows = h[:, rows], positions[rows], torch.arange(len(rows), device=h.device)
        for layer in self.layers[cfg.num_self_decoder_layers:]:
            h = layer(h, positions, ctx)
            if hiddens is not None:
                hiddens.append(h)
        return normed_outputs(self.norm, h, rows, hiddens)


class HySparse2ForCausalLM(ReferenceCausalLM):
    """Reference HySparse2 causal LM: exact SPEC §3.3 math with a KV cache, early exit and autograd."""

    config_class, model_class = HySparse2Config, HySparse2Model
    _no_split_modules = ["HySparse2DecoderLayer"]
