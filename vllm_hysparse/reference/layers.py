# SPDX-License-Identifier: Apache-2.0
"""Building blocks shared by the reference models: norm, RoPE, MLP and MoE, gates, sinks."""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RMSNorm(nn.Module):
    """Llama RMSNorm over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` dims of each head (SPEC §2.5).

    `inv_freq[i] = theta ** (-2i / rotary_dim)` (or the scaled frequencies of
    `rope_parameters["rope_type"]`); dims past `rotary_dim` pass through.
    """

    def __init__(self, rotary_dim: int, rope_parameters: dict, config=None):
        super().__init__()
        self.rotary_dim, self.rope_parameters, self.config = rotary_dim, dict(rope_parameters), config

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """(`[rotary_dim / 2]` float32 frequencies, attention scaling).

        Computed on every call rather than kept as a buffer: transformers builds
        models on the meta device and would leave a non-persistent buffer
        uninitialised after loading.
        """
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
            return (self.rope_parameters["rope_theta"] ** -exponent).float(), 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, "cpu")
        return inv_freq.float(), float(scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x `[B, T, heads, D]`, positions `[T]` -> rotated x (same shape and dtype)."""
        inv_freq, scaling = self.inv_freq()
        freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, rd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * scaling)[None, :, None, :]
        sin = (emb.sin() * scaling)[None, :, None, :]
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated_half * sin
        return torch.cat([out.to(x.dtype), rest], dim=-1)


class MLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE-style MoE MLP (SPEC §2.6), optionally with a Qwen2-MoE shared expert.

    A softmax router in float32 over `num_experts` picks the top
    `num_experts_per_tok` experts per token (ties broken as `torch.topk`
    does); their probabilities, renormalised to sum 1 when `norm_topk_prob`,
    weight the SwiGLU experts' outputs. The shared expert, if any, runs on
    every token, scaled by `sigmoid(shared_expert_gate x)`.
    """

    def __init__(self, config):
        super().__init__()
        e = config.hidden_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(e, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(e, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(e, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(e, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, hidden]` -> (weights `[N, k]` in x's dtype, expert ids `[N, k]`)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., hidden]` -> `[..., hidden]`."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        # Each expert runs once on the tokens that picked it (any of their k slots).
        for idx, expert in enumerate(self.experts):
            token, slot = torch.where(ids == idx)
            if token.numel():
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(x.shape)


def make_mlp(config, layer_idx: int) -> nn.Module:
    """The MLP of layer `layer_idx`: MoE unless the model is dense or the layer is in `mlp_only_layers`."""
    if config.is_moe_layer(layer_idx):
        return SparseMoeBlock(config)
    return MLP(config.hidden_size, config.intermediate_size)


def gate_proj(config, hidden_size: int) -> nn.Linear:
    """Gate projection: `[H*Dv, hidden]` elementwise or `[H, hidden]` headwise, no bias.

    Gates act on the attention output, so elementwise gates are `v_head_dim` wide per head.
    """
    width = config.num_attention_heads * (config.v_head_dim if config.gate_type == "elementwise" else 1)
    return nn.Linear(hidden_size, width, bias=False)


def gate_logits(proj: nn.Linear, x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[B, T, hidden]` -> gate logits `[B, T, H, Dv]` (elementwise) or `[B, T, H, 1]` (headwise)."""
    g = proj(x)
    return g.view(*g.shape[:2], num_heads, -1)


def sinks(config) -> nn.Parameter | None:
    """Per-head sink logits `[H]` in float32, or None without `use_sinks`."""
    if not config.use_sinks:
        return None
    return nn.Parameter(torch.zeros(config.num_attention_heads, dtype=torch.float32))


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[B, T, n*D]` -> `[B, T, n, D]`."""
    return x.view(*x.shape[:2], -1, head_dim)


# The largest finite e4m3 value: FP8 cache writes saturate there.
FP8_MAX = 448.0


def fp8_round(x: torch.Tensor, toward_zero: bool = False) -> torch.Tensor:
    """`x` through e4m3 at scale 1.0 and back: what an FP8 KV cache (`kv_cache_dtype="fp8"`) stores of it.

    Saturating at ±448, to nearest (our backend's writes, and vLLM's on GPU) or, with `toward_zero`, toward
    zero: vLLM 0.32's CPU write (`cpu_attn_reshape_and_cache`) truncates the mantissa.
    """
    q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if toward_zero:
        # e4m3 codes grow with the magnitude on either sign, so one code down is one step toward zero.
        over = q.to(x.dtype).abs() > x.abs()
        q = torch.where(over, (q.view(torch.uint8) - 1).view(torch.float8_e4m3fn), q)
    return q.to(x.dtype)


class Fp8KVCache(DynamicCache):
    """A reference KV cache that stores what an FP8 engine's caches store: every K/V row written is rounded to
    e4m3 (scale 1.0, no checkpoint scales), and attention reads the rounded rows back, as the engine reads its
    pages. `toward_zero`: the layers whose cache is written by vLLM's own CPU backend, which truncates.
    K/V computed without a cache (a PIC segment's isolated prefill) stay unrounded, as the segment store keeps
    them; they are rounded when spliced in, after their rotation, as the engine's cache write does."""

    def __init__(self, toward_zero: set[int] = frozenset(), **kwargs):
        super().__init__(**kwargs)
        self.toward_zero = set(toward_zero)
        # layer -> (K, V) `[B, G, T, D]` as written, before rounding: what PIC's segment store taps.
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def empty_like(self) -> "Fp8KVCache":
        return Fp8KVCache(self.toward_zero)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.written.get(layer_idx, (key_states[:, :, :0], value_states[:, :, :0]))
        self.written[layer_idx] = (torch.cat([k, key_states], 2), torch.cat([v, value_states], 2))
        rtz = layer_idx in self.toward_zero
        return super().update(fp8_round(key_states, rtz), fp8_round(value_states, rtz), layer_idx, *args, **kwargs)


def kv_from_cache(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
    """Append k `[B, T, G, D]` and v `[B, T, G, Dv]` for `layer_idx` to a transformers Cache; return all of it."""
    if cache is None:
        return k, v
    k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer_idx)
    return k_all.transpose(1, 2), v_all.transpose(1, 2)


@dataclass
class ReferenceSwitches:
    """Switches for validation (SPEC §5), all on by default (the real architecture).

    HySparse: `sparse_selection` (False: the global branch sees every causal
    key), `kv_sharing` (False: the sparse layer's global branch uses its own
    `swa_k_proj`/`swa_v_proj` KV and an oracle computed from it), `swa_branch`
    (False: the SWA branch is dropped and its gate weights the global branch).
    HySparse2: `cross_kv_sharing` (False: a cross sparse layer attends over
    K/V projected from its own normalised input instead of the cross full
    layer's cache; a HySparse2 checkpoint has no such projections, so they
    must be given with `CrossSparseAttention.set_own_kv` — the validator
    borrows the dense teacher's), `sliding_window` (False: sliding layers
    attend over the whole causal context; their RoPE, sink and gate are kept,
    so a converted layer at its neutral init, gate 0.5 behind `o_proj` x2 and
    sink -30, is its dense layer again), `token_selection` (False: cross
    sparse layers see every causal key), `forced_window` (False: the recent
    window is not forced; the top `k_g + w` tokens by score are taken),
    `bridge` (False: a cross full layer projects K/V from its own normalised
    input instead of the bridge source), `early_exit` (False: the
    cross-decoder runs on every position even when fewer logits are asked
    for; it is only exact, and only taken, with `bridge` and
    `cross_kv_sharing` on).
    """

    sparse_selection: bool = True
    kv_sharing: bool = True
    swa_branch: bool = True
    cross_kv_sharing: bool = True
    sliding_window: bool = True
    token_selection: bool = True
    forced_window: bool = True
    bridge: bool = True
    early_exit: bool = True
