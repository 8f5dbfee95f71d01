# SPDX-License-Identifier: Apache-2.0
"""One conversion decided before the first byte is written: `Conversion` (source, target config, dense
layout, source shards and headers, routes and new tensors), `plan_conversion` that builds it from the
source directory and a layer plan, and `describe`, the plan, parameter counts and KV bytes per token printed
before converting (and by `--dry-run`).
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_hysparse.configs.base import HySparseBaseConfig, kv_bytes_per_token
from vllm_hysparse.configs.tensors import expected_tensors, layer_kind
from vllm_hysparse.tools.convert.plan import PlanOptions, build_config
from vllm_hysparse.tools.convert.rename import SINK_INIT, route
from vllm_hysparse.tools.convert.source import (
    SOURCE_ARCHITECTURES,
    W,
    check_source,
    dense_fields,
    dense_layout,
    load_source_config,
    read_headers,
)


@dataclass
class Conversion:
    """Everything decided before the first byte is written."""

    src: Path
    source_type: str
    config: HySparseBaseConfig
    # the source's own layout: tensor -> shape
    dense: dict[str, tuple[int, ...]]
    # source file -> its tensor names, in file order
    shards: dict[str, list[str]]
    # source tensor -> (shape, dtype)
    headers: dict[str, tuple[tuple[int, ...], torch.dtype]]
    # source tensor -> ((target, scale), ...)
    routes: dict[str, tuple[tuple[str, float], ...]]
    # source tensor -> new target tensors written right after it
    inits: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def plan_conversion(src: str | Path, arch: str, opts: PlanOptions | None = None) -> Conversion:
    """Read the source's config and headers and decide every output tensor; raises on any problem."""
    src = Path(src)
    model_type, cfg = load_source_config(src)
    fields = dense_fields(model_type, cfg)
    dense = dense_layout(fields)
    config = build_config(arch, fields, opts or PlanOptions())
    config.dtype = cfg.dtype
    shards = read_headers(src)
    headers = {name: h for per_file in shards.values() for name, h in per_file.items()}
    if len(headers) != sum(map(len, shards.values())):
        twice = sorted({n for a in shards for b in shards if a < b for n in set(shards[a]) & set(shards[b])})
        raise ValueError(f"{src}: tensor(s) stored in more than one shard: {', '.join(twice[:5])}")
    check_source(src, model_type, dense, headers)
    routes, inits = route(config, headers)
    conv = Conversion(src, model_type, config, dense, {f: list(h) for f, h in shards.items()}, headers,
                      routes, inits)
    if arch == "hysparse2" and config.rope_scaling and config.layers_of_type(W):
        conv.warnings.append(
            f"rope_scaling {config.rope_parameters['rope_type']!r} does not reach the sliding layers: they "
            "use plain RoPE with swa_rope_theta (reference and vLLM), so they cannot match the teacher exactly")
    return conv


def _layer_line(config: HySparseBaseConfig, idx: int) -> str:
    kind = layer_kind(config, idx)
    if kind == "sparse":
        what = (f"global branch on layer {config.oracle_layer[idx]}'s KV; k/v -> swa_k/swa_v; "
                "+2 gates, +2 sinks; o x1")
    elif kind == "sliding":
        what = f"window {config.swa_window}; +gate, +sink; o x2"
    elif kind == "cross_full":
        what = f"k/v applied to layer {config.bridge_source[idx]}'s input; +bridge_norm"
    elif kind == "cross_sparse":
        what = f"reads layer {config.oracle_layer[idx]}'s cache; k/v dropped; +gate, +sink; o x2"
    else:
        what = "kept (q/k/v/o)"
    return f"  {idx:>5}  {kind:<12}  {what}"


def _sum_params(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


def _head_dims(cfg: HySparseBaseConfig) -> str:
    """`128`, or `192 (v 128)` when the value head dim is its own."""
    return str(cfg.head_dim) if cfg.v_head_dim == cfg.head_dim else f"{cfg.head_dim} (v {cfg.v_head_dim})"


def describe(conv: Conversion) -> str:
    """The plan, parameter counts and KV bytes per token before and after."""
    cfg = conv.config
    before, after = _sum_params(conv.dense.values()), _sum_params(expected_tensors(cfg).values())
    dtype = conv.headers["model.layers.0.self_attn.q_proj.weight"][1]
    width = torch.empty((), dtype=dtype).element_size()
    ctx = cfg.max_position_embeddings
    kv = kv_bytes_per_token(cfg, width, ctx)
    kv8 = kv_bytes_per_token(cfg, 1, ctx)
    opts = (f"block {cfg.sparse_block_size} x top-{cfg.sparse_topk_blocks}" if cfg.model_type == "hysparse" else
            f"{cfg.num_self_decoder_layers} self-decoder layers, top-{cfg.sparse_topk_tokens} tokens + "
            f"recent {cfg.recent_window}, bridges {cfg.bridge_sources}")
    lines = [
        f"source: {conv.src} ({SOURCE_ARCHITECTURES[conv.source_type]}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads x {_head_dims(cfg)}, "
        f"rope {cfg.rope_parameters['rope_type']} theta={cfg.rope_theta:g})",
        f"target: {cfg.model_type}: {opts}, swa_window {cfg.swa_window}, gates {cfg.gate_type}, sinks {SINK_INIT:g}",
        *([f"MLP: MoE, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}"
           f"{' renormalised' if cfg.norm_topk_prob else ''}, expert size {cfg.moe_intermediate_size}"
           f"{f', shared expert {cfg.shared_expert_intermediate_size}' if cfg.shared_expert_intermediate_size else ''}"
           f"{f', dense layers {cfg.mlp_only_layers}' if cfg.mlp_only_layers else ''} (copied)"]
          if cfg.num_experts else []),
        "  layer  type          conversion",
        *(_layer_line(cfg, i) for i in range(cfg.num_hidden_layers)),
        f"parameters: {before:,} -> {after:,} ({(after - before) / before:+.1%})",
        f"KV cache ({str(dtype).removeprefix('torch.')}) at {ctx:,} tokens: {kv['dense_bytes_per_token']:,.0f} "
        f"-> {kv['bytes_per_token']:,.0f} bytes/token ({kv['full_length_caches']} full-length + "
        f"{kv['window_caches']} window caches; {kv['dense_bytes_per_token'] / kv['bytes_per_token']:.1f}x less)",
        # kv_cache_dtype="fp8": one byte per element (its two scales per layer cost nothing per token)
        f"KV cache (kv_cache_dtype=fp8) at {ctx:,} tokens: {kv8['dense_bytes_per_token']:,.0f} "
        f"-> {kv8['bytes_per_token']:,.0f} bytes/token",
    ]
    return "\n".join(lines)
