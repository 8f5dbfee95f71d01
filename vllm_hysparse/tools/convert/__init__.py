# SPDX-License-Identifier: Apache-2.0
"""Convert a Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Qwen2-MoE checkpoint into HySparse or HySparse2 (SPEC §5).

    python scripts/convert_checkpoint.py --src Qwen3-8B --dst qwen3-8b-hysparse --arch hysparse --dry-run
    python scripts/convert_checkpoint.py --src model.gguf --dst student --arch hysparse   # GGUF: imported first
    python scripts/convert_checkpoint.py --src Qwen3-8B --dst student --arch hysparse --plan plan.json
        # the layer plan measured on the teacher by `python -m vllm_hysparse.recovery.plan`

Dense layer `i` becomes layer `i` of the target. Full layers keep their
weights; sparse and sliding layers reuse the dense q/k/v/o, with new gates at
zero weight (sigmoid = 0.5) and sinks at -30, and `o_proj` scaled so that a
layer whose branches all equal dense attention reproduces the dense layer
(x1 behind two gated branches, x2 behind one). Weights stream one tensor at a
time from the source shards into output shards of at most `--max-shard-size`,
so memory is bounded by one output shard, not by the model. MoE sources keep
their MLPs as they are (router, experts, shared expert; SPEC §2.6): only the
attention is converted.
"""

import argparse
import json
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig

from vllm_hysparse.configs import HySparse2Config, HySparseConfig
from vllm_hysparse.configs.base import HySparseBaseConfig, kv_bytes_per_token
from vllm_hysparse.configs.tensors import check_complete, check_tensor, expected_tensors, layer_kind
from vllm_hysparse.tools.make_checkpoint import parse_size
from vllm_hysparse.tools.staging import staged_output

F, S, W = "full_attention", "sparse_attention", "sliding_attention"
# exp(-30) is ~1e-13 of the softmax mass of any key: the sink starts switched off.
SINK_INIT = -30.0
SOURCE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# Qwen3(-MoE) normalises q and k per head; Qwen2 always has q/k/v biases, Qwen2-MoE when
# `qkv_bias` (SPEC §2.5 conventions).
QK_NORM = {"qwen3", "qwen3_moe"}
QKV_BIAS = {"qwen2", "qwen2_moe"}
MOE_SOURCES = {"qwen3_moe", "qwen2_moe"}
CONFIG_CLASSES = {"hysparse": HySparseConfig, "hysparse2": HySparse2Config}
COPIED_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                "*.tiktoken", "chat_template*", "generation_config.json")
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}

# (source pattern, target names, scale). Patterns match a whole name, layer
# patterns the part after `model.layers.{i}.`; the first match wins; no
# targets means the tensor is dropped on purpose. Anything unmatched is an error.
Rule = tuple[str, tuple[str, ...], float]
# fmt: off
_MLP_AND_NORMS: list[Rule] = [
    (r"(input|post_attention)_layernorm\.weight", (r"\1_layernorm.weight",),   1.0),
    (r"mlp\.(gate|up|down)_proj\.weight",         (r"mlp.\1_proj.weight",),     1.0),
    # MoE MLPs (SPEC §2.6) are copied; `route` checks each against the layer's layout.
    (r"mlp\.gate\.weight",                         ("mlp.gate.weight",),         1.0),
    (r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", (r"mlp.experts.\1.\2_proj.weight",), 1.0),
    (r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", (r"mlp.shared_expert.\1_proj.weight",), 1.0),
    (r"mlp\.shared_expert_gate\.weight",           ("mlp.shared_expert_gate.weight",), 1.0),
    # A buffer in some old checkpoints; RoPE frequencies come from the config.
    (r"self_attn\.rotary_emb\.inv_freq",          (),                           1.0),
]
_QKV_KEPT: list[Rule] = [
    (r"self_attn\.([qkv])_proj\.(weight|bias)",   (r"self_attn.\1_proj.\2",),   1.0),
    (r"self_attn\.([qk])_norm\.weight",           (r"self_attn.\1_norm.weight",), 1.0),
]
_Q_KEPT: list[Rule] = [
    (r"self_attn\.q_proj\.(weight|bias)",         (r"self_attn.q_proj.\1",),    1.0),
    (r"self_attn\.q_norm\.weight",                ("self_attn.q_norm.weight",), 1.0),
]
_O_X1: Rule = (r"self_attn\.o_proj\.weight",      ("self_attn.o_proj.weight",), 1.0)
# One gated branch at sigmoid(0) = 0.5 halves the output; o_proj doubles it back.
_O_X2: Rule = (r"self_attn\.o_proj\.weight",      ("self_attn.o_proj.weight",), 2.0)

LAYER_RULES: dict[str, list[Rule]] = {
    "full": [*_QKV_KEPT, _O_X1, *_MLP_AND_NORMS],
    # Two gated branches at 0.5 each: o_proj stays as is. The dense k/v become the SWA branch's.
    "sparse": [
        *_Q_KEPT,
        (r"self_attn\.([kv])_proj\.(weight|bias)", (r"self_attn.swa_\1_proj.\2",), 1.0),
        (r"self_attn\.k_norm\.weight",             ("self_attn.swa_k_norm.weight",), 1.0),
        _O_X1, *_MLP_AND_NORMS,
    ],
    "sliding": [*_QKV_KEPT, _O_X2, *_MLP_AND_NORMS],
    # bridge_norm starts as the layer's own input norm: the norm its k/v were trained behind.
    "cross_full": [
        (r"input_layernorm\.weight", ("input_layernorm.weight", "self_attn.bridge_norm.weight"), 1.0),
        *_QKV_KEPT, _O_X1, *_MLP_AND_NORMS,
    ],
    # Cross sparse layers own no KV: they read the cross full layer's cache.
    "cross_sparse": [
        *_Q_KEPT,
        (r"self_attn\.[kv]_proj\.(weight|bias)", (), 1.0),
        (r"self_attn\.k_norm\.weight",           (), 1.0),
        _O_X2, *_MLP_AND_NORMS,
    ],
}
_TOP_RULES: list[Rule] = [
    (r"model\.embed_tokens\.weight", ("model.embed_tokens.weight",), 1.0),
    (r"model\.norm\.weight",         ("model.norm.weight",),         1.0),
    (r"lm_head\.weight",             ("lm_head.weight",),            1.0),
]
# Target tensors no source tensor provides, and how they start.
INIT_RULES: list[tuple[str, str]] = [
    (r"model\.layers\.\d+\.self_attn\.(\w+_)?gate_proj\.weight", "zeros"),
    (r"model\.layers\.\d+\.self_attn\.(\w+_)?sinks",             "sinks"),
]
# fmt: on
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass
class PlanOptions:
    """Layer plan; None means the default derived from the model's depth."""

    full_period: int | None = None
    full_layers: list[int] | None = None
    block_size: int | None = None
    topk_blocks: int | None = None
    swa_window: int = 128
    gate_type: str = "elementwise"
    num_self_layers: int | None = None
    self_full_layers: list[int] | None = None
    cross_full_layers: list[int] | None = None
    bridge_sources: list[int] | None = None
    topk_tokens: int | None = None
    recent_window: int | None = None


HYSPARSE_ONLY = ("full_period", "full_layers", "block_size", "topk_blocks")
# An option given on the command line drops the `--plan` options chosen under it: a plan's bridge sources
# are self full layers of its own split, its full layers follow its own count.
PLAN_DEPENDENTS = {
    "full_period": ("full_layers",),
    "num_self_layers": ("self_full_layers", "cross_full_layers", "bridge_sources"),
    "self_full_layers": ("bridge_sources",),
    "cross_full_layers": ("bridge_sources",),
}
HYSPARSE2_ONLY = ("num_self_layers", "self_full_layers", "cross_full_layers", "bridge_sources",
                  "topk_tokens", "recent_window")


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


def load_source_config(src: Path) -> tuple[str, object]:
    """(model_type, transformers config) of a supported dense checkpoint."""
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"{src}: no config.json (is --src a Hugging Face checkpoint directory?)")
    raw = json.loads(path.read_text())
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    supported = ", ".join(SOURCE_ARCHITECTURES.values())
    if model_type not in SOURCE_ARCHITECTURES:
        raise ValueError(f"unsupported source architecture model_type={model_type!r} (supported: {supported})")
    if archs and archs != [SOURCE_ARCHITECTURES[model_type]]:
        raise ValueError(f"unsupported source architecture {archs} (supported: {supported})")
    return model_type, AutoConfig.from_pretrained(src)


def _rope_parameters(cfg) -> dict:
    rope = dict(cfg.rope_parameters or {})
    rope["rope_type"] = rope.pop("rope_type", rope.pop("type", "default"))
    partial = rope.pop("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"source partial_rotary_factor={partial} is not supported (SPEC §2.5 rotates whole heads)")
    return rope


def _check_no_sliding_window(model_type: str, cfg) -> None:
    """Refuse a dense model whose attention is windowed: converting it would change what it computes."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or window >= cfg.max_position_embeddings:
        return
    windowed = model_type == "mistral" or bool(getattr(cfg, "use_sliding_window", False))
    if windowed and W in (getattr(cfg, "layer_types", None) or [W]):
        raise ValueError(
            f"source uses sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{cfg.max_position_embeddings}); only full-attention dense models convert exactly")


def dense_fields(model_type: str, cfg) -> dict:
    """Config fields shared by both targets, taken from the dense config (SPEC §2.1 Llama fields)."""
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("source mlp_bias=true is not supported (HySparse MLPs have no biases)")
    if getattr(cfg, "attention_bias", False) and model_type not in QKV_BIAS:
        raise ValueError(f"source attention_bias=true gives {model_type} an o_proj bias, which HySparse "
                         "layers do not have (SPEC §2.5)")
    _check_no_sliding_window(model_type, cfg)
    heads = cfg.num_attention_heads
    qkv_bias = model_type in QKV_BIAS and bool(getattr(cfg, "qkv_bias", True))
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_key_value_heads or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        # A source with a value head size of its own (SPEC §2.6) keeps it; Llama-family configs have none.
        "v_head_dim": getattr(cfg, "v_head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "hidden_act": cfg.hidden_act, "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings), "rope_parameters": _rope_parameters(cfg),
        "attention_bias": qkv_bias, "qk_norm": model_type in QK_NORM,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        **moe_fields(model_type, cfg),
    }


def moe_fields(model_type: str, cfg) -> dict:
    """SPEC §2.6 fields of a Qwen3-MoE / Qwen2-MoE source; {} (dense) for the others.

    The source's `decoder_sparse_step` (MoE on layers i with (i + 1) % step == 0)
    becomes explicit `mlp_only_layers`, which is what we have.
    """
    if model_type not in MOE_SOURCES or not cfg.num_experts:
        return {}
    step = cfg.decoder_sparse_step
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"source decoder_sparse_step must be a positive integer (got {step!r})")
    dense = set(cfg.mlp_only_layers or []) | {i for i in range(cfg.num_hidden_layers) if (i + 1) % step}
    return {
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": bool(cfg.norm_topk_prob),
        "shared_expert_intermediate_size": getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
        "mlp_only_layers": sorted(dense),
    }


def read_headers(src: Path) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Source file -> {tensor: (shape, dtype)} from the safetensors headers (no tensor data read)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{src}: no model.safetensors or model.safetensors.index.json "
                         "(only safetensors checkpoints convert)")
    out = {}
    for fname in files:
        if not (src / fname).is_file():
            raise ValueError(f"{src}: shard {fname} named in the index does not exist")
        try:
            with safe_open(src / fname, framework="pt") as f:
                out[fname] = {name: _header(f, name) for name in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{src / fname}: truncated or corrupt safetensors file ({e})") from None
    return out


def _header(f, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    sl = f.get_slice(name)
    dtype = sl.get_dtype()
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"source tensor {name} has dtype {dtype}; only float tensors convert")
    return tuple(sl.get_shape()), SAFETENSORS_DTYPES[dtype]


def default_hysparse_full_layers(num_layers: int, period: int | None = None) -> list[int]:
    """Every `period`-th layer plus the last; period 4 (1:3, 7B paper) below 48 layers, else 12 (1:11, 80B)."""
    period = period or (12 if num_layers >= 48 else 4)
    return sorted({i for i in range(0, num_layers, period)} | {num_layers - 1})


def default_hysparse2_split(num_layers: int) -> int:
    """Self-decoder depth: half the layers, rounded up (25 of 49 in the paper)."""
    if num_layers < 2:
        raise ValueError(f"hysparse2 needs at least 2 layers (a self and a cross decoder); got {num_layers}")
    return (num_layers + 1) // 2


def default_cross_full_layers(num_layers: int, num_self: int) -> list[int]:
    """Cross-decoder blocks of [full, sparse x 5] (paper), [full, sparse x 2] below 16 layers."""
    block = 6 if num_layers >= 16 else 3
    return list(range(num_self, num_layers, block))


def _check_layers(option: str, layers: list[int], lo: int, hi: int, where: str) -> None:
    bad = [i for i in layers if not lo <= i < hi]
    if bad:
        raise ValueError(f"plan: --{option} has layer(s) {bad} outside {where} [{lo}, {hi})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"plan: --{option} lists a layer twice: {layers}")


def _or(value, default):
    return default if value is None else value


def hysparse_plan(num_layers: int, opts: PlanOptions) -> dict:
    if opts.full_period is not None and opts.full_period <= 0:
        raise ValueError(f"plan: --full-period must be a positive integer (got {opts.full_period})")
    full = opts.full_layers
    if full is None:
        full = default_hysparse_full_layers(num_layers, opts.full_period)
    _check_layers("full-layers", full, 0, num_layers, "the model's layers")
    return {
        "layer_types": [F if i in full else S for i in range(num_layers)],
        "sparse_block_size": _or(opts.block_size, 64), "sparse_topk_blocks": _or(opts.topk_blocks, 16),
    }


def hysparse2_plan(num_layers: int, opts: PlanOptions) -> dict:
    n_self = opts.num_self_layers
    if n_self is None:
        n_self = default_hysparse2_split(num_layers)
    if not 0 < n_self < num_layers:
        raise ValueError(f"plan: --num-self-layers must be in [1, {num_layers - 1}] (got {n_self})")
    self_full = _or(opts.self_full_layers, [n_self // 2])
    cross_full = opts.cross_full_layers
    if cross_full is None:
        cross_full = default_cross_full_layers(num_layers, n_self)
    _check_layers("self-full-layers", self_full, 0, n_self, "the self-decoder")
    _check_layers("cross-full-layers", cross_full, n_self, num_layers, "the cross-decoder")
    bridges = opts.bridge_sources
    if bridges is None:
        # All bridge from one self full layer (paper): the one nearest the self-decoder's middle.
        mid = min(self_full, key=lambda i: abs(i - n_self // 2), default=0)
        bridges = [mid] * len(cross_full)
    types = [(F if i in self_full else W) if i < n_self else (F if i in cross_full else S)
             for i in range(num_layers)]
    return {
        "layer_types": types, "num_self_decoder_layers": n_self, "bridge_sources": list(bridges),
        "sparse_topk_tokens": _or(opts.topk_tokens, 1024), "recent_window": _or(opts.recent_window, 128),
    }


def build_config(arch: str, fields: dict, opts: PlanOptions) -> HySparseBaseConfig:
    """Target config: the dense fields plus the layer plan, validated by the config class."""
    wrong = HYSPARSE2_ONLY if arch == "hysparse" else HYSPARSE_ONLY
    given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(opts, name) is not None]
    if given:
        raise ValueError(f"plan: {', '.join(given)} do(es) not apply to --arch {arch}")
    if opts.full_period is not None and opts.full_layers is not None:
        raise ValueError("plan: give --full-period or --full-layers, not both")
    num_layers = fields["num_hidden_layers"]
    plan = hysparse_plan(num_layers, opts) if arch == "hysparse" else hysparse2_plan(num_layers, opts)
    if arch == "hysparse2":
        # Dense models are RoPE models: keep RoPE on full/sparse layers and
        # rotate whole heads with the dense theta on sliding layers.
        plan.update(full_rope=True, swa_rope_theta=fields["rope_parameters"]["rope_theta"],
                    swa_rotary_dim=fields["head_dim"])
    try:
        return CONFIG_CLASSES[arch](**fields, **plan, swa_window=opts.swa_window, gate_type=opts.gate_type)
    except ValueError as e:
        raise ValueError(f"plan: {e}") from None


def map_name(config: HySparseBaseConfig, name: str) -> tuple[tuple[str, float], ...]:
    """Target names (with `o_proj`-style scale) of one source tensor; () = dropped; raises if unmapped."""
    m = LAYER_NAME.fullmatch(name)
    if m and int(m.group(1)) < config.num_hidden_layers:
        idx, rest = int(m.group(1)), m.group(2)
        kind = layer_kind(config, idx)
        return _apply(LAYER_RULES[kind], rest, f"model.layers.{idx}.", name, f"a {kind} layer")
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return ()
    return _apply(_TOP_RULES, name, "", name, "the top level")


def _apply(rules: list[Rule], key: str, prefix: str, name: str, where: str) -> tuple[tuple[str, float], ...]:
    for pattern, targets, scale in rules:
        m = re.fullmatch(pattern, key)
        if m:
            return tuple((prefix + m.expand(t), scale) for t in targets)
    raise ValueError(f"unknown source tensor {name}: no conversion rule for it in {where}")


def _init_kind(name: str) -> str | None:
    return next((kind for pattern, kind in INIT_RULES if re.fullmatch(pattern, name)), None)


def route(config: HySparseBaseConfig, headers: dict) -> tuple[dict, dict]:
    """(routes, inits): where each source tensor goes and which new tensors follow which source tensor."""
    expected = expected_tensors(config)
    routes, produced = {}, set()
    for name, (shape, _) in headers.items():
        routes[name] = map_name(config, name)
        for target, _ in routes[name]:
            check_tensor(expected, target, shape)
            if target in produced:
                raise ValueError(f"two source tensors map to {target}")
            produced.add(target)
    inits: dict[str, list[str]] = {}
    for target in expected:
        if target in produced:
            continue
        m = LAYER_NAME.fullmatch(target)
        if _init_kind(target) is None or m is None:
            raise ValueError(f"no source tensor or initialiser provides {target}")
        inits.setdefault(f"model.layers.{m.group(1)}.self_attn.q_proj.weight", []).append(target)
    return routes, inits


def dense_layout(fields: dict) -> dict[str, tuple[int, ...]]:
    """Tensors of the dense source: those of a HySparse model whose layers are all full."""
    try:
        config = HySparseConfig(**fields, layer_types=[F] * fields["num_hidden_layers"])
    except ValueError as e:
        raise ValueError(f"source config: {e}") from None
    return expected_tensors(config)


def check_source(src: Path, model_type: str, dense: dict, headers: dict) -> None:
    """The source must hold exactly its dense layout (plus tensors the table drops)."""
    for name, (shape, _) in headers.items():
        if name in dense:
            check_tensor(dense, name, shape)
    try:
        check_complete(dense, set(headers))
    except ValueError as e:
        raise ValueError(f"{src} ({model_type}): {e}") from None


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


class ShardWriter:
    """Collects output tensors and writes a shard whenever the next one would pass `max_bytes`."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.parts: list[tuple[str, list[str]]] = []
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        part = f".part-{len(self.parts):05d}.safetensors"
        save_file(self.buffer, str(self.out / part), metadata={"format": "pt"})
        self.parts.append((part, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def finish(self) -> list[str]:
        """Name the shards `model-0000i-of-0000n` (or `model.safetensors` alone) and write the index."""
        if self.buffer or not self.parts:
            self.flush()
        if len(self.parts) == 1:
            (self.out / self.parts[0][0]).rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        n, weight_map, names = len(self.parts), {}, []
        for i, (part, tensors) in enumerate(self.parts):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / part).rename(self.out / fname)
            weight_map.update(dict.fromkeys(tensors, fname))
            names.append(fname)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names


def _init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if _init_kind(name) == "sinks":
        # SPEC §2.2: sinks are float32 whatever the weight dtype.
        return torch.full(shape, SINK_INIT, dtype=torch.float32)
    return torch.zeros(shape, dtype=dtype)


def write_weights(conv: Conversion, out: Path, max_shard_bytes: int) -> list[str]:
    """Stream source shards one tensor at a time into output shards."""
    expected, writer = expected_tensors(conv.config), ShardWriter(out, max_shard_bytes)
    for fname, names in conv.shards.items():
        with safe_open(conv.src / fname, framework="pt") as f:
            for name in tqdm(names, desc=fname, unit="tensor"):
                tensor = f.get_tensor(name)
                for i, (target, scale) in enumerate(conv.routes[name]):
                    writer.add(target, tensor if i == 0 and scale == 1.0 else tensor * scale)
                for target in conv.inits.get(name, ()):
                    writer.add(target, _init_tensor(target, expected[target], tensor.dtype))
    return writer.finish()


def copy_side_files(src: Path, out: Path) -> list[str]:
    """Tokenizer files and generation config, byte for byte."""
    copied = sorted({p.name for pattern in COPIED_FILES for p in src.glob(pattern) if p.is_file()})
    for name in copied:
        shutil.copy2(src / name, out / name)
    return copied


def identity_switches(config: HySparseBaseConfig) -> dict[str, bool]:
    """Reference switches under which a converted model equals its teacher on short inputs."""
    return {"kv_sharing": False} if config.model_type == "hysparse" else {"bridge": False}


def identity_length(config: HySparseBaseConfig) -> int:
    """Longest input on which every block / token is selected and every window covers the sequence."""
    if config.model_type == "hysparse":
        cover = config.sparse_block_size * config.sparse_topk_blocks
    else:
        cover = config.sparse_topk_tokens + config.recent_window
    return min(64, config.swa_window, cover)


def identity_depth(config: HySparseBaseConfig) -> int:
    """Number of layers a converted model reproduces exactly under `identity_switches`.

    A HySparse2 cross sparse layer attends over the cross full layer's cache
    and has no k/v of its own (no switch can give it its teacher's keys), so
    the match ends at the first one.
    """
    if config.model_type == "hysparse":
        return config.num_hidden_layers
    return min(config.layers_of_type(S), default=config.num_hidden_layers)


def verify(conv: Conversion, out: Path, tol: float = 1e-3) -> str:
    """Teacher vs converted reference model (float32) under the identity switches.

    Compares logits, or for HySparse2 with cross sparse layers the hidden
    states entering the first of them (see `identity_depth`).
    """
    from transformers import AutoModelForCausalLM

    from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM

    cfg = conv.config
    cls = HySparseForCausalLM if cfg.model_type == "hysparse" else HySparse2ForCausalLM
    teacher = AutoModelForCausalLM.from_pretrained(conv.src, dtype=torch.float32).eval()
    student = cls.from_pretrained(out, dtype=torch.float32).eval()
    student.set_switches(**identity_switches(cfg))
    length, depth = identity_length(cfg), identity_depth(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(ids, output_hidden_states=True)
        got = student(ids, use_cache=False, output_hidden_states=True)
    if depth == cfg.num_hidden_layers:
        what, want, got = "logits", want.logits, got.logits
    else:
        what, want, got = f"hidden states entering layer {depth}", want.hidden_states[depth], got.hidden_states[depth]
    err, scale = (want.float() - got.float()).abs().max().item(), want.abs().max().item()
    line = f"verify: {what}: max |difference| {err:.2e} (max |value| {scale:.2f}) over {length} tokens"
    if not err <= tol * max(scale, 1.0):
        raise ValueError(f"{line} exceeds {tol:g} relative: the conversion does not reproduce the teacher")
    return line


def convert(conv: Conversion, dst: str | Path, *, force: bool = False, max_shard_bytes: int = 5 << 30,
            check: bool = False, calibrate=None) -> Path:
    """Write the converted checkpoint into a temporary directory beside `dst`, then move it there.

    Refuses a non-empty `dst` unless `force`; a failure (including `check`,
    the logits match against the teacher), Ctrl-C or kill leaves `dst`
    untouched (see `vllm_hysparse.tools.staging`). `calibrate(tmp)`, when
    given, then rewrites the staged weights (`--calibrate`: recovery stage 0).
    """
    dst = Path(dst)
    _check_destination(conv.src, dst, force)
    with staged_output(dst) as tmp:
        conv.config.save_pretrained(tmp)
        copy_side_files(conv.src, tmp)
        write_weights(conv, tmp, max_shard_bytes)
        check_written(conv.config, tmp)
        if check:
            print(verify(conv, tmp))
        if calibrate is not None:
            calibrate(tmp)
            check_written(conv.config, tmp)
    return dst


def calibrator(src: str, text_path: str, tokens: int, max_shard_size: str):
    """`--calibrate`: stage 0 of recovery (`vllm_hysparse.recovery.init`) on the staged checkpoint, in place."""
    text = Path(text_path).read_text(encoding="utf-8", errors="replace")

    def run(tmp: Path) -> None:
        from vllm_hysparse.recovery.init import initialise_checkpoint

        student, report = initialise_checkpoint(src, tmp, text, tokens=tokens, seq_len=min(tokens, 2048))
        for old in [*tmp.glob("*.safetensors"), *tmp.glob("*.safetensors.index.json")]:
            old.unlink()
        student.save_pretrained(tmp, max_shard_size=max_shard_size)
        report["calibration"] = text_path
        (tmp / "init.json").write_text(json.dumps(report, indent=2))
        print(f"calibrate: stage 0 on {report['tokens']} tokens of {text_path} (report init.json)")

    return run


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    if dst.resolve() == src.resolve():
        raise ValueError("--dst must differ from --src")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"{dst} exists and is not empty; pass --force to replace it")


def check_written(config: HySparseBaseConfig, out: Path) -> None:
    """The written tensors are exactly `expected_tensors(config)` (what vLLM's loader checks)."""
    expected, seen = expected_tensors(config), set()
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                check_tensor(expected, name, tuple(f.get_slice(name).get_shape()))
                seen.add(name)
    check_complete(expected, seen)


def read_plan(path: str, arch: str) -> dict:
    """A `vllm_hysparse.recovery.plan` report, checked to be one for `arch` whose options are PlanOptions fields."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--plan {path}: unreadable ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("options"), dict):
        raise ValueError(f"--plan {path}: no \"options\" (is it a report of python -m vllm_hysparse.recovery.plan?)")
    if report.get("arch") != arch:
        raise ValueError(f"--plan {path} is a plan for --arch {report.get('arch')}, not {arch}")
    unknown = sorted(set(report["options"]) - set(PlanOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"--plan {path}: unknown option(s) {unknown}")
    return report


def plan_file_options(report: dict, path: str, num_layers: int) -> dict:
    """The plan's chosen options, once it is known to fit a model of `num_layers` layers."""
    if report.get("num_hidden_layers") != num_layers:
        raise ValueError(f"--plan {path} was measured on a model of {report.get('num_hidden_layers')} layers; "
                         f"--src has {num_layers}")
    options = report["options"]
    for name, value in options.items():
        if isinstance(value, list):
            bad = [i for i in value if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
            if bad:
                raise ValueError(f"--plan {path}: {name} has layer(s) {bad} outside the model's layers "
                                 f"[0, {num_layers})")
    return options


def plan_options(args, src: str, plan: dict | None) -> PlanOptions:
    """Options given on the command line, over the `--plan` report's chosen options (see PLAN_DEPENDENTS)."""
    given = {name: getattr(args, name) for name in PlanOptions.__dataclass_fields__ if getattr(args, name) is not None}
    chosen = {}
    if plan is not None:
        chosen = dict(plan_file_options(plan, args.plan, load_source_config(Path(src))[1].num_hidden_layers))
        for name in given:
            for dependent in PLAN_DEPENDENTS.get(name, ()):
                chosen.pop(dependent, None)
        print(f"plan: {args.plan} chose {chosen}" + (f"; from the command line: {given}" if given else ""))
    return PlanOptions(**{**chosen, **given})


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, e.g. 0,4,8 (got {text!r})")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="HF checkpoint (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, "
                   "Qwen2-MoE), or a .gguf file of one (imported first, see vllm_hysparse.tools.import_gguf)")
    p.add_argument("--dst", required=True, help="directory to create")
    p.add_argument("--arch", choices=sorted(CONFIG_CLASSES), required=True)
    full = p.add_mutually_exclusive_group()
    full.add_argument("--full-period", type=int, help="hysparse: full layer every N layers, plus the last "
                      "(default 4 below 48 layers, else 12)")
    full.add_argument("--full-layers", type=_layer_list, help="hysparse: explicit full layers, e.g. 0,4,8")
    p.add_argument("--block-size", type=int, help="hysparse: sparse_block_size (default 64)")
    p.add_argument("--topk-blocks", type=int, help="hysparse: sparse_topk_blocks (default 16)")
    p.add_argument("--swa-window", type=int, help="SWA branch / sliding layer window (default 128)")
    p.add_argument("--gate-type", choices=["elementwise", "headwise"], help="default elementwise")
    p.add_argument("--num-self-layers", type=int, help="hysparse2: self-decoder depth (default: half, rounded up)")
    p.add_argument("--self-full-layers", type=_layer_list, help="hysparse2: full self-decoder layers "
                   "(default: the middle one); the others are sliding")
    p.add_argument("--cross-full-layers", type=_layer_list, help="hysparse2: full cross-decoder layers "
                   "(default: blocks of [full, sparse x 5], x 2 below 16 layers); the others are sparse")
    p.add_argument("--bridge-sources", type=_layer_list, help="hysparse2: self full layer per cross full layer "
                   "(default: all the self full layer nearest the self-decoder's middle)")
    p.add_argument("--topk-tokens", type=int, help="hysparse2: sparse_topk_tokens (default 1024)")
    p.add_argument("--recent-window", type=int, help="hysparse2: recent_window (default 128)")
    p.add_argument("--plan", metavar="PLAN_JSON", help="take the layer plan from a report of python -m "
                   "vllm_hysparse.recovery.plan (measured on the teacher); options given here win over it")
    p.add_argument("--dry-run", action="store_true", help="print the plan, parameters and KV bytes; write nothing")
    p.add_argument("--verify", action="store_true", help="compare logits with the teacher before publishing "
                   "(loads both models in float32)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --dst")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size, e.g. 500MB")
    p.add_argument("--calibrate", metavar="TEXT", help="text file: fit the converted layers on the teacher's "
                   "activations over it (recovery stage 0, see docs/recovery.md) instead of copying only")
    p.add_argument("--calibrate-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    return p


@contextmanager
def _dense_source(src: str, dst: Path):
    """`src`, or for a `.gguf` file its dense import in a temporary directory beside `dst` (removed after)."""
    if not src.lower().endswith(".gguf"):
        yield src
        return
    from vllm_hysparse.tools.import_gguf import dense_source

    with dense_source(src, dst.parent) as dense:
        yield dense


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """The command line; `prog` names the command in `--help` (default: the script's file name)."""
    args = build_parser(prog).parse_args(argv)
    try:
        # The plan file is checked before a GGUF source is imported; its layers once the source is known.
        plan = read_plan(args.plan, args.arch) if args.plan else None
        with _dense_source(args.src, Path(args.dst)) as src:
            conv = plan_conversion(src, args.arch, plan_options(args, src, plan))
            print(describe(conv))
            for warning in conv.warnings:
                print(f"warning: {warning}", file=sys.stderr)
            if args.dry_run:
                return 0
            calibrate = (calibrator(src, args.calibrate, args.calibrate_tokens, args.max_shard_size)
                         if args.calibrate else None)
            out = convert(conv, args.dst, force=args.force, max_shard_bytes=parse_size(args.max_shard_size),
                          check=args.verify, calibrate=calibrate)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
