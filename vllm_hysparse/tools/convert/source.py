# SPDX-License-Identifier: Apache-2.0
"""The dense source checkpoint: its config (which architectures convert, the fields both targets share) and
its safetensors headers (file -> {tensor: (shape, dtype)}, read without the tensor data), checked against
the dense layout the config implies (tensor -> shape, that of a HySparse model whose layers are all full).
Also the layer type names F, S, W used across the converter.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from vllm_hysparse.configs import HySparseConfig
from vllm_hysparse.configs.tensors import check_complete, check_tensor, expected_tensors

F, S, W = "full_attention", "sparse_attention", "sliding_attention"
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
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


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
