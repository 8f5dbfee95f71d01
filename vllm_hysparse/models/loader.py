# SPDX-License-Identifier: Apache-2.0
"""Strict weight loading for both vLLM models: HF tensor names to vLLM's fused parameters, every tensor checked
(name, shape, dtype, finite, quantised layout) and the checkpoint checked complete for this pipeline stage."""

import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import SafetensorError
from torch import nn
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import is_pp_missing_parameter

from vllm_hysparse.configs.base import HySparseBaseConfig
from vllm_hysparse.configs.tensors import (
    check_complete,
    check_finite,
    check_tensor,
    expected_tensors,
    layer_kind,
    unreadable_files_message,
)

# Per layer kind: HF module under `self_attn.` / `mlp.` -> (vLLM parameter owner, shard id).
# `{i}` is the layer index; owners outside the layer (HySparse2 bridges) say so.
StackTable = dict[str, dict[str, tuple[str, str | int]]]
MLP_STACK = {"gate_proj": ("model.layers.{i}.mlp.gate_up_proj", 0), "up_proj": ("model.layers.{i}.mlp.gate_up_proj", 1)}
QKV_STACK = {"q_proj": ("model.layers.{i}.self_attn.qkv_proj", "q"), "k_proj": ("model.layers.{i}.self_attn.qkv_proj", "k"),
             "v_proj": ("model.layers.{i}.self_attn.qkv_proj", "v")}
SHARED_EXPERT_STACK = {"gate_proj": ("model.layers.{i}.mlp.shared_expert.gate_up_proj", 0),
                       "up_proj": ("model.layers.{i}.mlp.shared_expert.gate_up_proj", 1)}
# The only names ever renamed: `model.layers.{i}.{group}.{module}.{leaf}` (the leaf may be a quant tensor).
RENAMED = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|mlp\.shared_expert)\.(\w+)\.(\w+)")
# A routed expert's tensor: (`model.layers.{i}.mlp.`, `experts.{e}.{proj}.`, leaf).
EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.mlp\.)(experts\.\d+\.\w+\.)(\w+)")
# Parameter dtypes that plain float weights must never be copied into (or come from): a cast would drop scales.
PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def vllm_param_name(config: HySparseBaseConfig, stacks: StackTable, name: str) -> tuple[str, str | int | None]:
    """HF tensor name -> (vLLM parameter name, shard id of a fused parameter or None)."""
    m = RENAMED.fullmatch(name)
    if m is None:
        return name, None
    idx, group, module, leaf = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    table = {"mlp": MLP_STACK, "mlp.shared_expert": SHARED_EXPERT_STACK}.get(group)
    if table is None:
        table = stacks.get(layer_kind(config, idx), {})
    if module not in table:
        return name, None
    owner, shard = table[module]
    return f"{owner.format(i=idx)}.{leaf}", shard


def expert_mapping(model: nn.Module, config: HySparseBaseConfig) -> dict[str, tuple[str, int, str]]:
    """vLLM's expert mapping, keyed by checkpoint part: `experts.{e}.{proj}.` -> (param part, expert, shard)."""
    if not config.num_experts:
        return {}
    mapping = fused_moe_make_expert_params_mapping(model, "gate_proj", "down_proj", "up_proj", config.num_experts)
    return {weight_part: (param_part, expert, shard) for param_part, weight_part, expert, shard in mapping}


class Route:
    """Where each checkpoint tensor goes: vLLM parameter, shard id, expert id (SPEC §2.2, §2.6)."""

    def __init__(self, model: nn.Module, config: HySparseBaseConfig, stacks: StackTable):
        self.config, self.stacks = config, stacks
        self.experts = expert_mapping(model, config)

    def __call__(self, name: str) -> tuple[str, str | int | None, int | None]:
        m = EXPERT_TENSOR.fullmatch(name)
        if m is not None and m.group(2) in self.experts:
            # One expert's gate / up / down (or its scales): a slice of the layer's stacked w13 or w2.
            param_part, expert, shard = self.experts[m.group(2)]
            return f"{m.group(1)}{param_part}{m.group(3)}", shard, expert
        target, shard = vllm_param_name(self.config, self.stacks, name)
        return target, shard, None


def quantised_layout(model: nn.Module, route: Route, expected: dict[str, tuple[int, ...]]
                     ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The checkpoint layout under the model's quant methods: (plain tensors and shapes, quant tensor names).

    A quant method registers its own parameters on each linear it owns:
    FP8 keeps `weight` and adds `weight_scale` (or `weight_scale_inv`,
    `input_scale`); GPTQ / AWQ replace `weight` by `qweight`, `scales`, ....
    Each checkpoint module stacked into that linear (every shard of a fused
    one, every expert) must then carry the same tensors. Without a quant
    config this returns `expected` unchanged and no quant tensors.
    """
    own = {name: set(module._parameters) for name, module in model.named_modules()}
    plain, quant = dict(expected), set()
    for name in expected:
        if not name.endswith(".weight"):
            continue
        target, _, _ = route(name)
        owner, leaf = target.rsplit(".", 1)
        stem = leaf[: -len("weight")]  # "" for a linear, "w13_" / "w2_" for stacked experts
        params = {p for p in own.get(owner, ()) if p.startswith(stem)} - {f"{stem}bias", "bias"}
        if not params or params == {leaf}:
            continue  # an unquantised module
        module = name[: -len(".weight")]
        if leaf not in params:
            del plain[name]  # the method stores the weight under other names
        quant.update(f"{module}.{p[len(stem):]}" for p in params - {leaf})
    return plain, quant


def check_dtype(name: str, weight: torch.Tensor, target: str, param: torch.Tensor) -> None:
    """Refuse a quantised tensor for a plain parameter, or a plain float one for a quantised parameter.

    vLLM's loaders copy with a cast, so either way the load would succeed and
    serve garbage (FP8 codes read as values, or float weights cast to FP8 with
    no scale).
    """
    if weight.dtype == param.dtype or (weight.dtype in PLAIN_FLOATS and param.dtype in PLAIN_FLOATS):
        return
    raise ValueError(f"checkpoint tensor {name} is {weight.dtype} but vLLM parameter {target} is {param.dtype} "
                     "(does config.json's quantization_config match the checkpoint and its ignored modules?)")


def load_checked(model: nn.Module, config: HySparseBaseConfig, stacks: StackTable,
                 weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Strict loading: an unknown, missing, mis-shaped or non-finite tensor is a one-line error naming it.

    Quantised checkpoints: each linear's quant method (vLLM's `quant_config`)
    decides which extra tensors its checkpoint modules carry (see
    `quantised_layout`); they are routed like the weight, with the shard id of
    a fused parameter, through the parameter's own `weight_loader`.
    Under pipeline parallelism a stage loads its own layers; another stage's
    tensors are checked by name and shape where the plain layout knows them,
    and fully (quant tensors, completeness) on the stage that holds them.
    """
    route = Route(model, config, stacks)
    plain, quant = quantised_layout(model, route, expected_tensors(config))
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, weight in readable(config, weights):
        target, shard, expert = route(name)
        elsewhere = is_pp_missing_parameter(target, model)
        if name not in quant and not (elsewhere and name not in plain):
            check_not_quantised(plain, name)
            check_tensor(plain, name, tuple(weight.shape))
        check_finite(name, weight)
        seen.add(name)
        if elsewhere:
            continue
        param = params[target]
        check_dtype(name, weight, target, param)
        load_one(name, weight, target, param, shard, expert)
    here = {n for n in [*plain, *quant] if not is_pp_missing_parameter(route(n)[0], model)}
    check_complete(dict.fromkeys(here), seen)
    return set(params)


def check_not_quantised(plain: dict[str, tuple[int, ...]], name: str) -> None:
    """A quant tensor (`weight_scale`, ...) of a module that runs unquantised: one line saying so."""
    module, leaf = name.rsplit(".", 1)
    if name not in plain and leaf not in ("weight", "bias") and f"{module}.weight" in plain:
        raise ValueError(f"checkpoint has unexpected tensor {name}: module {module} is not quantised by this model's "
                         "quantization config (config.json has no quantization_config, or it ignores the module)")


def load_one(name: str, weight: torch.Tensor, target: str, param: torch.Tensor, shard, expert) -> None:
    """One tensor through its parameter's `weight_loader`; a loader's refusal becomes one line naming both."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        if expert is not None:
            loader(param, weight, target, shard_id=shard, expert_id=expert)
        elif shard is None:
            loader(param, weight)
        else:
            loader(param, weight, shard)
    except (AssertionError, RuntimeError, ValueError, IndexError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint tensor {name} (shape {tuple(weight.shape)}, {weight.dtype}) does not fit "
                         f"vLLM parameter {target} (shape {tuple(param.shape)}): {reason}") from None


def readable(config: HySparseBaseConfig, weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, with safetensors' file errors (which name no file) turned into one line that does."""
    it = iter(weights)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except SafetensorError as e:
            raise ValueError(unreadable_files_message(config.name_or_path, e)) from None
        yield item
