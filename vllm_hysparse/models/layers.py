# SPDX-License-Identifier: Apache-2.0
"""Layers both vLLM models build: fused projections, the MoE / dense MLP, the pre-norm decoder block, per-head norm,
gates, sinks, the LM head, and the `Attention` keywords of layers whose cache layout differs from vLLM's default."""

import torch
from torch import nn
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.qwen3_moe import Qwen3MoeMLP
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index
from vllm.platforms import current_platform
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

from vllm_hysparse.configs.base import HySparseBaseConfig, kv_report
from vllm_hysparse.models.tp_heads import HeadSplit

# Under the "vllm" logger tree so vLLM's log configuration prints it.
logger = init_logger("vllm.hysparse")


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


def cache_dtype_of(cache_config) -> str:
    """The KV cache dtype a layer is built for (`auto` without a cache config)."""
    return cache_config.cache_dtype if cache_config is not None else "auto"


def plain_full_attention(config: HySparseBaseConfig, cache_config) -> dict:
    """`Attention` keywords of a full-length causal layer with no oracle.

    It runs on our backend's `dense` role in two cases: with `v_head_dim != head_dim`,
    because our cache stores V at its own width (vLLM's CPU backend cannot, and
    padding V there would cost full-length bytes); and on the CPU where our tiled
    kernel serves it (`serves_plain_attention`: a prompt shared by several decode
    rows is read once for all of them). Empty otherwise: vLLM picks the backend.
    """
    from vllm_hysparse.attention.backend import HySparseAttentionBackend, serves_plain_attention

    if config.v_head_dim == config.head_dim and not serves_plain_attention(cache_dtype_of(cache_config)):
        return {}
    return dict(attn_backend=HySparseAttentionBackend, hysparse_role="dense", **separate_v(config))


def window_attention(config: HySparseBaseConfig, sinks: nn.Parameter | None, cache_config) -> dict:
    """`Attention` keywords of a sliding-window layer with sinks (HySparse's SWA branch, HySparse2's sliding layers).

    The layer runs on our backend's `window` role where our tiled C++ kernel
    serves it (`serves_plain_attention`: CPU, float32, unquantised cache): its
    window walk took 0.68-0.74x of the time of vLLM's CPU sliding-window
    kernel on a prefill chunk (three runs) and 0.8x on eight decode rows
    (window 128, 12 heads, 4 KV groups, 2-core AMD EPYC;
    benchmarks/results/experiments/window_kernel_2026-12-07.md). Also with
    `v_head_dim != head_dim`, which stores V at its own width: vLLM 0.32's
    CPU backend (`CPU_ATTN`) splits a page into equal K and V halves and takes
    one head size. Padding V to `head_dim` there would not stay in these
    window caches: vLLM unifies page sizes across cache groups, padding every
    smaller page to the largest when it does not divide it, so the
    full-length caches would pay for the padding too. Elsewhere (GPU, FP8
    caches, bf16) vLLM picks its own backend.
    """
    from vllm_hysparse.attention.backend import HySparseAttentionBackend, WindowSelection, serves_plain_attention

    args = dict(per_layer_sliding_window=config.swa_window, sinks=sinks)
    if config.v_head_dim != config.head_dim:
        args.update(head_size_v=config.v_head_dim)
    if config.v_head_dim != config.head_dim or serves_plain_attention(cache_dtype_of(cache_config)):
        args.update(attn_backend=HySparseAttentionBackend, hysparse_role="window",
                    selection=WindowSelection(config.swa_window))
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


def project_qkv(proj: nn.Module, heads, hidden_states: torch.Tensor, q_norm: RMSNorm | None,
                k_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[T, hidden]` through a fused q/k/v projection -> q `[T, H*D]`, k `[T, G*D]`, v `[T, G*Dv]` of this rank,
    q and k normed per head (where the config has `qk_norm`), before RoPE."""
    qkv, _ = proj(hidden_states)
    q, k, v = heads.split_qkv(qkv)
    return head_norm(q, q_norm, heads.head_dim), head_norm(k, k_norm, heads.head_dim), v


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
