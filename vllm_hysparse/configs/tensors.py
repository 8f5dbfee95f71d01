# SPDX-License-Identifier: Apache-2.0
"""The tensors a checkpoint must contain, by name and shape (SPEC §2.2, §2.4, §2.6).

One table drives strict loading everywhere: a tensor missing from it, absent
from the checkpoint, or of another shape is an error that names the tensor.
"""

from pathlib import Path

from vllm_hysparse.configs.base import HySparseBaseConfig


def _norm(prefix: str, dim: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (dim,)}


def _linear(prefix: str, out_dim: int, in_dim: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (out_dim, in_dim)}
    if bias:
        shapes[f"{prefix}.bias"] = (out_dim,)
    return shapes


def _attention_parts(config: HySparseBaseConfig, kind: str) -> dict[str, tuple[int, ...]]:
    """`self_attn.*` tensors of one layer kind (see `layer_kind`)."""
    h, g, d, e = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    dv, bias = config.v_head_dim, config.attention_bias
    # q/k are `head_dim` wide, V and everything downstream of it `v_head_dim` (SPEC §2.6).
    gate_width = h * dv if config.gate_type == "elementwise" else h
    out = {**_linear("q_proj", h * d, e, bias), **_linear("o_proj", e, h * dv, False)}
    if config.qk_norm:
        out.update(_norm("q_norm", d))
    if kind in ("full", "sliding", "cross_full"):
        out.update(_linear("k_proj", g * d, e, bias))
        out.update(_linear("v_proj", g * dv, e, bias))
        if config.qk_norm:
            out.update(_norm("k_norm", d))
    if kind == "cross_full":
        out.update(_norm("bridge_norm", e))
    if kind == "sparse":
        out.update(_linear("swa_k_proj", g * d, e, bias))
        out.update(_linear("swa_v_proj", g * dv, e, bias))
        out.update(_linear("sparse_gate_proj", gate_width, e, False))
        out.update(_linear("swa_gate_proj", gate_width, e, False))
        if config.use_sinks:
            out.update({"sparse_sinks": (h,), "swa_sinks": (h,)})
        if config.qk_norm:
            out.update(_norm("swa_k_norm", d))
    if kind in ("sliding", "cross_sparse"):
        out.update(_linear("gate_proj", gate_width, e, False))
        if config.use_sinks:
            out["sinks"] = (h,)
    return out


def layer_kind(config: HySparseBaseConfig, layer_idx: int) -> str:
    """One of full, sparse (HySparse); full, sliding, cross_full, cross_sparse (HySparse2)."""
    kind = config.layer_types[layer_idx]
    if config.model_type == "hysparse":
        return "full" if kind == "full_attention" else "sparse"
    if layer_idx < config.num_self_decoder_layers:
        return "full" if kind == "full_attention" else "sliding"
    return "cross_full" if kind == "full_attention" else "cross_sparse"


def _swiglu(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (inner, hidden), f"{prefix}.up_proj.weight": (inner, hidden),
            f"{prefix}.down_proj.weight": (hidden, inner)}


def _mlp_parts(config: HySparseBaseConfig, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """`mlp.*` tensors of one layer: a dense SwiGLU MLP or a MoE block (SPEC §2.6)."""
    e = config.hidden_size
    if not config.is_moe_layer(layer_idx):
        return _swiglu("mlp", e, config.intermediate_size)
    out = {"mlp.gate.weight": (config.num_experts, e)}
    for x in range(config.num_experts):
        out.update(_swiglu(f"mlp.experts.{x}", e, config.moe_intermediate_size))
    if config.shared_expert_intermediate_size:
        out.update(_swiglu("mlp.shared_expert", e, config.shared_expert_intermediate_size))
        out["mlp.shared_expert_gate.weight"] = (1, e)
    return out


def expected_tensors(config: HySparseBaseConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a checkpoint for `config`, mapped to its shape."""
    e = config.hidden_size
    out = {"model.embed_tokens.weight": (config.vocab_size, e), "model.norm.weight": (e,)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, e)
    for idx in range(config.num_hidden_layers):
        p = f"model.layers.{idx}."
        out.update({f"{p}self_attn.{k}": v for k, v in _attention_parts(config, layer_kind(config, idx)).items()})
        out.update({f"{p}input_layernorm.weight": (e,), f"{p}post_attention_layernorm.weight": (e,)})
        out.update({f"{p}{k}": v for k, v in _mlp_parts(config, idx).items()})
    return out


def check_tensor(expected: dict[str, tuple[int, ...]], name: str, shape: tuple[int, ...]) -> None:
    """Raise a one-line ValueError when `name` is unknown or mis-shaped."""
    if name not in expected:
        raise ValueError(f"checkpoint has unexpected tensor {name} (not part of this config's layout)")
    if tuple(shape) != expected[name]:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(shape)}, expected {expected[name]}")


def check_finite(name: str, tensor) -> None:
    """Raise a one-line ValueError when a floating-point tensor holds NaN or infinity.

    Such weights load without complaint and serve garbage (or NaN logits
    that sample token 0); one pass over each tensor at load time is cheap.
    """
    import torch

    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor = tensor.float()  # FP8 weights: isfinite has no float8 kernel
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        raise ValueError(f"checkpoint tensor {name} has non-finite values ({nan} NaN, {inf} inf of "
                         f"{tensor.numel()}); the checkpoint is corrupt")


def check_complete(expected: dict[str, tuple[int, ...]], seen: set[str]) -> None:
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")


def unreadable_files_message(model_dir: str, error: Exception) -> str:
    """One line naming the safetensors file(s) of `model_dir` that cannot be read, and why."""
    from safetensors import SafetensorError, safe_open

    bad = []
    for path in sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    f.get_slice(name)
        except SafetensorError as e:
            bad.append(f"{path} ({e})")
    if not bad:
        return f"a checkpoint file of {model_dir or 'the model'} is truncated or corrupt ({error})"
    return f"truncated or corrupt checkpoint file(s): {'; '.join(bad)}; rewrite or re-download them"
