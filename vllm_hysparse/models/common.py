# SPDX-License-Identifier: Apache-2.0
"""Pieces both vLLM models share: head split under TP, per-head norm, gates, sinks, MoE, strict loading."""

import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import SafetensorError
from torch import nn
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.model_loader.weight_utils import default_weight_loader, sharded_weight_loader
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.qwen3_moe import Qwen3MoeMLP
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, is_pp_missing_parameter
from vllm.platforms import current_platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

from vllm_hysparse.configs.base import HySparseBaseConfig, kv_report, tensor_parallel_heads
from vllm_hysparse.configs.tensors import (
    check_complete,
    check_finite,
    check_tensor,
    expected_tensors,
    layer_kind,
    unreadable_files_message,
)

# Under the "vllm" logger tree so vLLM's log configuration prints it.
logger = init_logger("vllm.hysparse")

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


def qkv_and_out(config: HySparseBaseConfig, prefix: str, quant_config: QuantizationConfig | None = None,
                qkv_name: str = "qkv_proj") -> tuple[QKVParallelLinear, RowParallelLinear]:
    """Fused q/k/v projection (v `v_head_dim` wide) and the output projection of an attention layer.

    `qkv_name` is the fused module's attribute name: its prefix must be the
    parameter path, which quantization configs match against.
    """
    qkv = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                            config.num_key_value_heads, bias=config.attention_bias, quant_config=quant_config,
                            prefix=f"{prefix}.{qkv_name}", v_head_size=config.v_head_dim)
    return qkv, out_proj(config, prefix, quant_config)


def out_proj(config: HySparseBaseConfig, prefix: str, quant_config: QuantizationConfig | None = None
             ) -> RowParallelLinear:
    """`o_proj` `[hidden, H * v_head_dim]`: it reads the attention output, which is as wide as V."""
    return RowParallelLinear(config.num_attention_heads * config.v_head_dim, config.hidden_size, bias=False,
                             quant_config=quant_config, prefix=f"{prefix}.o_proj")


def check_expert_parallel(num_experts: int, moe_parallel_config, on_cpu: bool) -> None:
    """Refuse expert parallelism that cannot run: on CPU, or with a size that does not divide `num_experts`.

    vLLM 0.32's CPU MoE kernel ignores the expert map, so with EP it indexes
    its local experts with global ids and crashes (a segfault in
    `cpu_fused_moe`). An uneven split vLLM would allow; we want every rank to
    hold and run the same number of experts (and EPLB requires it anyway).
    """
    if not moe_parallel_config.use_ep:
        return
    if on_cpu:
        raise ValueError("enable_expert_parallel: vLLM's CPU MoE kernel does not support expert parallelism "
                         "(it ignores the expert map); use tensor parallelism on CPU")
    if num_experts % moe_parallel_config.ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel size "
                         f"{moe_parallel_config.ep_size} (tensor x data parallel) with enable_expert_parallel")


class SparseMoeBlock(nn.Module):
    """MoE MLP (SPEC §2.6) on vLLM's fused MoE: router gate, routed experts, optional shared expert.

    Same math as the reference `SparseMoeBlock`: softmax top-k routing in
    float32, renormalised when `norm_topk_prob`; the shared expert's output is
    scaled by `sigmoid(shared_expert_gate x)` and added to the routed sum.
    """

    def __init__(self, config: HySparseBaseConfig, prefix: str, quant_config: QuantizationConfig | None = None):
        super().__init__()
        e = config.hidden_size
        # Assigned before `experts`, which holds them too: their parameters keep these names.
        # The router takes the quant config as in vLLM's Qwen3-MoE (checkpoints usually list it
        # as ignored); the one-wide shared-expert gate never does, as in Qwen2/3-MoE.
        self.gate = ReplicatedLinear(e, config.num_experts, bias=False, quant_config=quant_config,
                                     prefix=f"{prefix}.gate")
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert_gate = ReplicatedLinear(e, 1, bias=False, quant_config=None,
                                                       prefix=f"{prefix}.shared_expert_gate")
            # Not reduced on its own: the fused MoE reduces shared + routed once under TP.
            self.shared_expert = Qwen3MoeMLP(e, config.shared_expert_intermediate_size, config.hidden_act,
                                             quant_config=quant_config, reduce_results=False,
                                             expert_gate=self.shared_expert_gate, prefix=f"{prefix}.shared_expert")
        self.experts = FusedMoEFactory(
            num_experts=config.num_experts, top_k=config.num_experts_per_tok, hidden_size=e,
            intermediate_size=config.moe_intermediate_size, renormalize=config.norm_topk_prob,
            quant_config=quant_config, prefix=f"{prefix}.experts", gate=self.gate,
            shared_experts=self.shared_expert)
        check_expert_parallel(config.num_experts, self.experts.moe_config.moe_parallel_config,
                              current_platform.is_cpu())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` -> `[T, hidden]`; the runner applies the gate, so the logits argument is the input."""
        return self.experts(hidden_states=hidden_states, router_logits=hidden_states)


def make_mlp(config: HySparseBaseConfig, layer_idx: int, prefix: str,
             quant_config: QuantizationConfig | None = None) -> nn.Module:
    """MoE unless the model is dense or the layer is in `mlp_only_layers` (SPEC §2.6)."""
    if config.is_moe_layer(layer_idx):
        return SparseMoeBlock(config, prefix, quant_config)
    return Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config=quant_config,
                    prefix=prefix)


def separate_v(config: HySparseBaseConfig) -> dict:
    """`Attention` keywords of a cache our backend owns: V stored at its own width (`FullAttentionSpec.head_size_v`).

    Empty for `v_head_dim == head_dim`, so the default layout is built exactly as before.
    """
    return {} if config.v_head_dim == config.head_dim else {"head_size_v": config.v_head_dim}


def plain_full_attention(config: HySparseBaseConfig) -> dict:
    """`Attention` keywords of a full-length causal layer with no oracle (no backend of its own by default).

    With `v_head_dim != head_dim` it runs on our backend's `dense` role, which
    stores V at its own width; vLLM's CPU backend cannot, and padding V there
    would cost full-length bytes. Empty otherwise: vLLM picks the backend as before.
    """
    if config.v_head_dim == config.head_dim:
        return {}
    from vllm_hysparse.attention.backend import HySparseAttentionBackend

    return dict(attn_backend=HySparseAttentionBackend, hysparse_role="dense", head_size_v=config.v_head_dim)


def window_attention(config: HySparseBaseConfig, sinks: nn.Parameter | None) -> dict:
    """`Attention` keywords of a sliding-window layer with sinks (HySparse's SWA branch, HySparse2's sliding layers).

    By default vLLM picks its own backend. With `v_head_dim != head_dim` the
    layer runs on our backend's `window` role instead, which stores V at its
    own width: vLLM 0.32's CPU backend (`CPU_ATTN`) splits a page into equal K
    and V halves and takes one head size. Padding V to `head_dim` there would
    not stay in these window caches: vLLM unifies page sizes across cache
    groups, padding every smaller page to the largest when it does not divide
    it, so the full-length caches would pay for the padding too.
    """
    args = dict(per_layer_sliding_window=config.swa_window, sinks=sinks)
    if config.v_head_dim != config.head_dim:
        from vllm_hysparse.attention.backend import HySparseAttentionBackend, WindowSelection

        args.update(attn_backend=HySparseAttentionBackend, hysparse_role="window",
                    selection=WindowSelection(config.swa_window), head_size_v=config.v_head_dim)
    return args


class PreNormDecoderLayer(nn.Module):
    """Pre-norm residual block around any attention module, with vLLM's fused residual adds."""

    def __init__(self, config: HySparseBaseConfig, attn: nn.Module, prefix: str,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.self_attn = attn
        self.mlp = make_mlp(config, extract_layer_index(prefix), f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        self.on_residual_stream(positions, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def on_residual_stream(self, positions: torch.Tensor, residual: torch.Tensor) -> None:
        """Hook: sees the residual stream entering this layer (HySparse2 bridges read it)."""


def maybe_head_norm(config: HySparseBaseConfig) -> RMSNorm | None:
    return RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None


def head_norm(x: torch.Tensor, norm: RMSNorm | None, head_dim: int) -> torch.Tensor:
    """Per-head RMSNorm of `[T, n*D]` (identity without `qk_norm`)."""
    if norm is None:
        return x
    return norm(x.view(*x.shape[:-1], -1, head_dim)).view(x.shape)


def gate_width(config: HySparseBaseConfig) -> int:
    """Output width of a gate projection: `H*Dv` elementwise, `H` headwise (SPEC §2.5, §2.6)."""
    return config.num_attention_heads * (config.v_head_dim if config.gate_type == "elementwise" else 1)


def apply_gate(gate_logits: torch.Tensor, o: torch.Tensor, heads: HeadSplit) -> torch.Tensor:
    """sigmoid(gate) `[T, H*Dv]` or `[T, H]` times attention output o `[T, H*Dv]`, in float32."""
    o = o.float().view(o.shape[0], heads.num_heads, heads.head_dim_v)
    gate = gate_logits.float().sigmoid().view(o.shape[0], heads.num_heads, -1)
    return (gate * o).view(o.shape[0], -1)


def make_sinks(config: HySparseBaseConfig, heads: HeadSplit) -> nn.Parameter | None:
    """`[H / tp]` float32 sink logits of this rank, or None without `use_sinks`."""
    if not config.use_sinks:
        return None
    sinks = nn.Parameter(torch.empty(heads.num_heads, dtype=torch.float32), requires_grad=False)
    sinks.weight_loader = sharded_weight_loader(0)
    return sinks


def make_lm_head(config: HySparseBaseConfig, vllm_config, embed_tokens: nn.Module, prefix: str) -> nn.Module:
    """The LM head on the last pipeline stage (tied to `embed_tokens` if the config says so), elsewhere a placeholder."""
    if not get_pp_group().is_last_rank:
        return PPMissingLayer()
    head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config, prefix=prefix)
    return head.tie_weights(embed_tokens) if config.tie_word_embeddings else head


def log_kv_report(config: HySparseBaseConfig, vllm_config) -> None:
    # the cache's own dtype: 1 byte per element with kv_cache_dtype="fp8" (its scales are per layer, not per token)
    cache_dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)
    dtype_bytes = torch.tensor([], dtype=cache_dtype).element_size()
    logger.info(kv_report(config, dtype_bytes, vllm_config.cache_config.kv_cache_memory_bytes,
                          vllm_config.parallel_config.tensor_parallel_size))


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
