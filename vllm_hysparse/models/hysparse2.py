# SPDX-License-Identifier: Apache-2.0
"""Inference-only HySparse2 model compatible with HySparse2 checkpoints (SPEC §2.3, §2.4, §3.3).

Self-decoder: full and sliding layers, each owning its cache. Cross-decoder:
full and sparse layers owning **no** cache. Each cross full layer's K/V are
*bridged*: projected from the residual stream entering a self-decoder full
layer and stored, during the self-decoder pass, into a cache owned by a
"bridge" `Attention` built before every cross-decoder layer. Cross layers
share that cache (vLLM KV sharing): the cross full layer attends over it and
picks per query and KV group the recent window ∪ top-k tokens; its sparse
followers attend over those tokens with one sink softmax.

Because every cross-decoder `Attention` shares KV and comes last, vLLM's
KV-sharing fast prefill applies: with it (on by default, see
`vllm_hysparse.models.config_hooks`) prompt tokens run the self-decoder and the bridge
projections only, and the cross-decoder runs on the rows whose logits are
needed (prefill early exit, exact by construction).

Follows vLLM's `vllm/model_executor/models/gemma3n.py` for that early exit
(`fast_prefill_forward`: the self-decoder on every token, the cross-decoder on
the logits rows only, copied into static buffers first) and `qwen3.py` for the
layers themselves. It differs from gemma3n in: the
cross-decoder's K/V come from bridges projected off the self-decoder's residual
stream rather than from the self-decoder's own caches, the sparse cross layers
attend over per-query selected tokens, and there is no AltUp / per-layer
embedding; from qwen3 as `hysparse.py` does (gates, sinks, MoE, strict loader).
"""


import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
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

from vllm_hysparse.attention.backend import HySparseAttentionBackend, TokenSelection
from vllm_hysparse.attention.bridge import bridge_kv_write
from vllm_hysparse.configs import HySparse2Config
from vllm_hysparse.configs.tensors import layer_kind
from vllm_hysparse.models.causal_lm import HybridForCausalLM
from vllm_hysparse.models.layers import (
    PreNormDecoderLayer,
    apply_gate,
    gate_width,
    head_norm,
    make_sinks,
    maybe_head_norm,
    out_proj,
    plain_full_attention,
    project_qkv,
    qkv_and_out,
    separate_v,
    window_attention,
)
from vllm_hysparse.models.loader import QKV_STACK
from vllm_hysparse.models.tp_heads import HeadSplit
from vllm_hysparse.vllm_glue.forward_context import batch_described, fast_prefill_logits

# HF module under `self_attn.` -> (vLLM parameter owner, shard id); bridged K/V live in `model.bridges`.
STACKS = {
    "full": QKV_STACK,
    "sliding": QKV_STACK,
    "cross_full": {
        "k_proj": ("model.bridges.{i}.kv_proj", 0), "v_proj": ("model.bridges.{i}.kv_proj", 1),
        "k_norm": ("model.bridges.{i}.k_norm", None), "bridge_norm": ("model.bridges.{i}.bridge_norm", None),
    },
}


def bridge_layer_name(cross_layer: int) -> str:
    return f"model.bridges.{cross_layer}.attn"


def _rope(config: HySparse2Config, sliding: bool):
    if sliding:
        params = {"rope_type": "default", "rope_theta": config.swa_rope_theta, "rope_dim": config.swa_rotary_dim}
        return get_rope(config.head_dim, max_position=config.max_position_embeddings, rope_parameters=params)
    if not config.full_rope:
        return None  # NoPE on full and sparse layers (SPEC §2.3)
    return get_rope(config.head_dim, max_position=config.max_position_embeddings,
                    rope_parameters=config.rope_parameters)


def _rotate(rope, positions, q, k=None):
    if rope is None:
        return q, k
    return rope(positions, q, k)


class HySparse2Bridge(nn.Module):
    """K/V of cross full layer `c` from the residual stream entering its bridge source; owns its cache."""

    def __init__(self, config: HySparse2Config, cache_config, cross_layer: int, prefix: str,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.heads = h = HeadSplit(config)
        g = config.num_key_value_heads
        self.bridge_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.kv_proj = MergedColumnParallelLinear(config.hidden_size, [g * config.head_dim, g * config.v_head_dim],
                                                  bias=config.attention_bias, quant_config=quant_config,
                                                  prefix=f"{prefix}.kv_proj", **h.kv_parallel())
        self.k_norm = maybe_head_norm(config)
        self.rotary_emb = _rope(config, sliding=False)
        self.layer_name = bridge_layer_name(cross_layer)
        self.attn = Attention(h.num_heads, config.head_dim, config.head_dim**-0.5, num_kv_heads=h.num_kv_heads,
                              cache_config=cache_config, prefix=self.layer_name,
                              attn_backend=HySparseAttentionBackend, hysparse_role="kv_owner", **separate_v(config))
        # Only ordered by the write op; never read.
        self.register_buffer("write_dependency", torch.zeros(1), persistent=False)

    def forward(self, positions: torch.Tensor, h_src: torch.Tensor) -> None:
        h = self.heads
        kv, _ = self.kv_proj(self.bridge_norm(h_src))
        k, v = h.own_kv(kv)
        k = head_norm(k, self.k_norm, h.head_dim)
        if self.rotary_emb is not None:
            k = _rotate_alone(self.rotary_emb, positions, k)
        bridge_kv_write(k.view(-1, h.num_kv_heads, h.head_dim), v.contiguous().view(-1, h.num_kv_heads, h.head_dim_v),
                        self.write_dependency, self.layer_name)


def _rotate_alone(rope, positions, x):
    """RoPE on one `[T, n*D]` tensor (a bridged K or a cross-decoder q): q and k rotate alike."""
    x, _ = rope(positions, x, None)
    return x


class HySparse2SelfAttention(nn.Module):
    """Self-decoder layer: full (NoPE unless `full_rope`) or sliding (partial RoPE, sink, gate)."""

    def __init__(self, config: HySparse2Config, cache_config, sliding: bool, prefix: str,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.heads = h = HeadSplit(config)
        self.sliding = sliding
        self.qkv_proj, self.o_proj = qkv_and_out(config, prefix, quant_config)
        self.q_norm, self.k_norm = maybe_head_norm(config), maybe_head_norm(config)
        self.rotary_emb = _rope(config, sliding)
        extra = plain_full_attention(config, cache_config)
        if sliding:
            self.gate_proj = ColumnParallelLinear(config.hidden_size, gate_width(config), bias=False,
                                                  quant_config=quant_config, prefix=f"{prefix}.gate_proj")
            self.sinks = make_sinks(config, h)
            extra = window_attention(config, self.sinks, cache_config)
        self.attn = Attention(h.num_heads, config.head_dim, config.head_dim**-0.5, num_kv_heads=h.num_kv_heads,
                              cache_config=cache_config, prefix=f"{prefix}.attn", **extra)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.heads
        q, k, v = project_qkv(self.qkv_proj, h, hidden_states, self.q_norm, self.k_norm)
        q, k = _rotate(self.rotary_emb, positions, q, k)
        o = self.attn(q, k, v)
        if self.sliding:
            gate, _ = self.gate_proj(hidden_states)
            o = apply_gate(gate, o, h).to(hidden_states.dtype)
        out, _ = self.o_proj(o)
        return out


class HySparse2CrossAttention(nn.Module):
    """Cross-decoder layer: full (attends the bridged cache, selects tokens) or sparse (attends the selection)."""

    def __init__(self, config: HySparse2Config, cache_config, full: bool, cache_layer: int,
                 index_buffer: torch.Tensor, prefix: str, quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.heads = h = HeadSplit(config)
        self.full = full
        self.q_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * config.head_dim,
                                           bias=config.attention_bias, quant_config=quant_config,
                                           prefix=f"{prefix}.q_proj")
        self.o_proj = out_proj(config, prefix, quant_config)
        self.q_norm = maybe_head_norm(config)
        self.rotary_emb = _rope(config, sliding=False)
        selection = TokenSelection(config.sparse_topk_tokens, config.recent_window, config.score_head_reduce)
        extra = dict(hysparse_role="token_oracle", index_buffer=index_buffer, selection=selection)
        if not full:
            self.gate_proj = ColumnParallelLinear(config.hidden_size, gate_width(config), bias=False,
                                                  quant_config=quant_config, prefix=f"{prefix}.gate_proj")
            self.sinks = make_sinks(config, h)
            extra.update(hysparse_role="token_sparse", sinks=self.sinks)
        # The token oracle runs its whole KV group's query heads (see `HeadSplit.group_query`).
        num_heads = h.oracle_heads if full else h.num_heads
        self.attn = Attention(num_heads, config.head_dim, config.head_dim**-0.5, num_kv_heads=h.num_kv_heads,
                              cache_config=cache_config, prefix=f"{prefix}.attn",
                              kv_sharing_target_layer_name=bridge_layer_name(cache_layer),
                              attn_backend=HySparseAttentionBackend, **separate_v(config), **extra)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj(hidden_states)
        q = head_norm(q, self.q_norm, self.heads.head_dim)
        if self.rotary_emb is not None:
            q = _rotate_alone(self.rotary_emb, positions, q)
        if self.full:
            o = self.heads.own_heads(self.attn(self.heads.group_query(q), None, None))
        else:
            o = self.attn(q, None, None)
            gate, _ = self.gate_proj(hidden_states)
            o = apply_gate(gate, o, self.heads).to(hidden_states.dtype)
        out, _ = self.o_proj(o)
        return out


class HySparse2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HySparse2Config, attn: nn.Module, bridges: list[HySparse2Bridge], prefix: str,
                 quant_config: QuantizationConfig | None = None):
        super().__init__(config, attn, prefix, quant_config)
        self.layer_idx = extract_layer_index(prefix)
        # Bridges whose source is this layer; a plain list: they are registered under `model.bridges`.
        self.bridges = bridges

    def on_residual_stream(self, positions: torch.Tensor, residual: torch.Tensor) -> None:
        for bridge in self.bridges:
            bridge(positions, residual)


def source_key(layer: int) -> str:
    """`IntermediateTensors` key of the residual stream entering self layer `layer`, carried to later stages."""
    return f"bridge_source_{layer}"


def _run_layers(layers, positions, hidden_states, residual, taps: frozenset[int] = frozenset()):
    """Run `layers`; also return the residual streams entering the layers indexed in `taps` (in layer order)."""
    tapped = []
    for layer in layers:
        if layer.layer_idx in taps:
            # What the layer's fused add-norm will form as its residual: the stream a bridge reads.
            tapped.append(hidden_states if residual is None else hidden_states + residual)
        hidden_states, residual = layer(positions, hidden_states, residual)
    return hidden_states, residual, tapped


@support_torch_compile(enable_if=lambda c: c.cache_config.kv_sharing_fast_prefill)
class HySparse2SelfDecoder(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layers: list[nn.Module],
                 taps: frozenset[int] = frozenset()):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.taps = taps

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """This stage's self-decoder layers; returns (hidden, residual, *tapped bridge sources)."""
        hidden_states, residual, tapped = _run_layers(self.layers, positions, hidden_states, residual, self.taps)
        return (hidden_states, residual, *tapped)


@support_torch_compile(enable_if=lambda c: c.cache_config.kv_sharing_fast_prefill)
class HySparse2CrossDecoder(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual, _ = _run_layers(self.layers, positions, hidden_states, residual)
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0},
    enable_if=lambda c: not c.cache_config.kv_sharing_fast_prefill)
class HySparse2Model(nn.Module):
    """Embedding, this pipeline stage's layers and bridges, final norm.

    Under pipeline parallelism (see `vllm_hysparse.models.pipeline`) a bridge
    is built on the stage of its cross full layer, next to the layers that
    share its cache. When its source self layer is on an earlier stage, the
    residual stream entering that layer travels with the hidden states as
    an extra `IntermediateTensors` entry (`source_key`), and the bridge
    writes its cache from it at the start of this stage's pass.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: HySparse2Config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        self.config = config
        self.fast_prefill = cache_config.kv_sharing_fast_prefill
        heads = HeadSplit(config)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        width = config.sparse_topk_tokens + config.recent_window
        pp = get_pp_group()
        # This stage's layers; the config hook has checked that no cross-decoder block straddles stages.
        start, end = get_pp_indices(config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        here = range(start, end)
        # One token-selection buffer per cross full layer of this stage: [tokens, G, k_g + w] positions.
        # Registered (non-persistent) so they live on the model's device; the attention layers hold references.
        index_buffers = {}
        for c in config.cross_full_layers:
            if c in here:
                self.register_buffer(f"index_buffer_{c}", torch.full((max_tokens, heads.num_kv_heads, width), -1,
                                                                     dtype=torch.int32), persistent=False)
                index_buffers[c] = getattr(self, f"index_buffer_{c}")
        self.quant_config = quant_config = vllm_config.quant_config
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                    prefix=f"{prefix}.embed_tokens")
                             if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank)
                             else PPMissingLayer())
        # Bridges own caches, so they are built before any cross-decoder Attention: vLLM's fast
        # prefill needs every Attention after the last cache owner to share KV.
        self.bridges = nn.ModuleDict({
            str(c): HySparse2Bridge(config, cache_config, c, prefix=f"{prefix}.bridges.{c}", quant_config=quant_config)
            if c in here else PPMissingLayer() for c in config.cross_full_layers})
        sources = config.bridge_source
        # Bridge sources this stage receives (bridge here, source earlier), and sends (bridge later).
        self.received = sorted({s for c, s in sources.items() if c >= start and s < start})
        self.sent = sorted({s for c, s in sources.items() if c >= end and s < end})
        self.remote_bridges = [(s, [self.bridges[str(c)] for c, src in sources.items() if src == s and c in here])
                               for s in self.received]
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: self._make_layer(config, cache_config, extract_layer_index(prefix), index_buffers,
                                            here, prefix),
            prefix=f"{prefix}.layers")
        n_self = config.num_self_decoder_layers
        mine = list(self.layers[start:end])
        self_layers = [layer for layer in mine if layer.layer_idx < n_self]
        self.taps = frozenset(s for s in self.sent if s in here)
        from vllm.compilation.backends import set_model_tag

        with set_model_tag("self_decoder"):
            self.self_decoder = HySparse2SelfDecoder(vllm_config=vllm_config, prefix=f"{prefix}.self_decoder",
                                                     layers=self_layers, taps=self.taps)
        with set_model_tag("cross_decoder"):
            self.cross_decoder = HySparse2CrossDecoder(vllm_config=vllm_config, prefix=f"{prefix}.cross_decoder",
                                                       layers=mine[len(self_layers):])
        self.has_self, self.has_cross = bool(self_layers), len(self_layers) < len(mine)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual", *map(source_key, self.received)], config.hidden_size)
        if self.fast_prefill and self.has_cross:
            # Static inputs of the cross-decoder: a captured graph replays on fixed addresses,
            # so the logits rows are copied here instead of passed as fresh gathers.
            dtype = vllm_config.model_config.dtype
            self.register_buffer("cross_positions", torch.zeros(max_tokens, dtype=torch.long), persistent=False)
            self.register_buffer("cross_hidden", torch.zeros(max_tokens, config.hidden_size, dtype=dtype),
                                 persistent=False)
            self.register_buffer("cross_residual", torch.zeros(max_tokens, config.hidden_size, dtype=dtype),
                                 persistent=False)

    def _make_layer(self, config, cache_config, i, index_buffers, here, prefix) -> HySparse2DecoderLayer:
        kind = layer_kind(config, i)
        quant_config = self.quant_config
        if kind in ("full", "sliding"):
            attn = HySparse2SelfAttention(config, cache_config, kind == "sliding", f"{prefix}.self_attn", quant_config)
        else:
            cache_layer = i if kind == "cross_full" else config.oracle_layer[i]
            attn = HySparse2CrossAttention(config, cache_config, kind == "cross_full", cache_layer,
                                           index_buffers[cache_layer], f"{prefix}.self_attn", self.quant_config)
        # Bridges of this stage whose source is this layer; the others get their source carried over.
        bridges = [self.bridges[str(c)] for c, src in config.bridge_source.items() if src == i and c in here]
        return HySparse2DecoderLayer(config, attn, bridges, prefix, self.quant_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        """`[T]` ids (first stage) or the previous stage's tensors -> last stage's normed `[T, hidden]`."""
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual, carried = None, {}
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
            carried = {s: intermediate_tensors[source_key(s)] for s in self.received}
        for s, bridges in self.remote_bridges:
            for bridge in bridges:
                bridge(positions, carried[s])
        if self.fast_prefill:
            hidden_states, residual, tapped = self._early_exit_forward(positions, hidden_states, residual)
        else:
            hidden_states, residual, tapped = _run_layers(self.layers[self.start_layer:self.end_layer], positions,
                                                          hidden_states, residual, self.taps)
        if not get_pp_group().is_last_rank:
            carried.update(zip(sorted(self.taps), tapped))
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual,
                                        **{source_key(s): carried[s] for s in self.sent}})
        if residual is None:  # the early exit has normed the logits rows already
            return hidden_states
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _logits_rows(self) -> tuple[torch.Tensor | None, int | None]:
        """(row indices, count) whose logits this step needs, from the fast-prefill metadata."""
        if not self.has_cross:  # no cross-decoder layer on this stage
            return None, None
        return fast_prefill_logits(self.layers[self.end_layer - 1].self_attn.attn.layer_name)

    def _early_exit_forward(self, positions, hidden_states, residual):
        """Self-decoder (and bridges) on every row; cross-decoder on the logits rows only (SPEC §3.3).

        Returns (hidden, residual, tapped bridge sources). On the last stage the
        logits rows come back normed, with residual None; on an earlier stage
        they are scattered back into full-size hidden and residual tensors.
        Rows without logits keep self-decoder values: no later cross layer and
        not the sampler reads them (every stage's cross layers share KV, so
        each stage's cross-decoder runs on the logits rows again).
        """
        tapped = []
        if self.has_self:  # a stage may hold no self-decoder layer: then there is no graph to compile
            hidden_states, residual, *tapped = self.self_decoder(positions, hidden_states, residual)
        rows, count = self._logits_rows()
        if rows is None:  # decode-only step, profiling, or no cross layer here: every row runs
            if self.has_cross:
                hidden_states, residual = self.cross_decoder(positions, hidden_states, residual)
            return hidden_states, residual, tapped
        n = rows.shape[0]  # padded by vLLM to a size it may capture
        self.cross_positions[:n].copy_(positions[rows])
        self.cross_hidden[:n].copy_(hidden_states[rows])
        self.cross_residual[:n].copy_(residual[rows])
        with batch_described(n):  # the cross-decoder's smaller batch, to vLLM's graph dispatch
            out, cross_residual = self.cross_decoder(self.cross_positions[:n], self.cross_hidden[:n],
                                                     self.cross_residual[:n])
        result = hidden_states.clone()
        if get_pp_group().is_last_rank:
            out, _ = self.norm(out, cross_residual)
            result[rows[:count]] = out[:count]
            return result, None, tapped
        result[rows[:count]] = out[:count]
        residual = residual.clone()
        residual[rows[:count]] = cross_residual[:count]
        return result, residual, tapped


def bridge_names(config: HySparse2Config):
    """A `WeightsMapper` from a cross full layer's `k_proj` / `v_proj` to its bridge's.

    Their weights live in `model.bridges.{c}.kv_proj`, but the checkpoint, its
    quantization config and a LoRA adapter name `model.layers.{c}.self_attn.k_proj`.
    Which layers are bridged depends on the config, so this cannot be a
    class-level `hf_to_vllm_mapper`.
    """
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper(orig_to_new_prefix=bridge_prefixes(config))


def bridge_prefixes(config: HySparse2Config) -> dict[str, str]:
    """Checkpoint name -> vLLM name of each bridged projection (see `bridge_names`)."""
    return {f"model.layers.{c}.self_attn.{proj}": f"model.bridges.{c}.{proj}"
            for c in config.cross_full_layers for proj in ("k_proj", "v_proj")}


class HySparse2ForCausalLM(HybridForCausalLM, SupportsLoRA):
    config_class, model_class, stacks = HySparse2Config, HySparse2Model, STACKS
    # Fused vLLM module -> the checkpoint modules it stacks (quantization ignore lists, LoRA).
    # A bridge's kv_proj stacks its cross full layer's k_proj and v_proj (see `bridge_names`).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "kv_proj": ["k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def before_body(self, vllm_config: VllmConfig) -> None:
        # The bridged K/V's names: for the quantization config's module lists (vLLM asks whether
        # `model.bridges.{c}.k_proj` is skipped) and for LoRA adapters (vllm/lora/worker_manager.py reads
        # `hf_to_vllm_mapper` off the model instance when it loads one).
        self.hf_to_vllm_mapper = bridge_names(self.config)
        if vllm_config.quant_config is not None:
            vllm_config.quant_config.apply_vllm_mapper(self.hf_to_vllm_mapper)

    def lora_renames(self) -> dict[str, str]:
        return bridge_prefixes(self.config)
