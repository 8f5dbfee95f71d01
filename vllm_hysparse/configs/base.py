# SPDX-License-Identifier: Apache-2.0
"""Fields and validation shared by the HySparse and HySparse2 configs (SPEC §2)."""

from typing import Any

from transformers import PreTrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GATE_TYPES = ("elementwise", "headwise")


def config_error(field: str, rule: str, value: Any) -> ValueError:
    """One-line error that names the field, the rule it broke and the value."""
    return ValueError(f"{field}: {rule} (got {value!r})")


def require_positive_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise config_error(field, "must be a positive integer", value)


def require_choice(field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise config_error(field, f"must be one of {list(choices)}", value)


def require_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise config_error(field, "must be true or false", value)


def require_non_negative_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise config_error(field, "must be a non-negative integer", value)


class HySparseBaseConfig(PreTrainedConfig):
    """Llama fields plus the options both architectures share.

    Subclasses set `model_type`, add their own fields, and extend `_validate`.
    Validation runs once, at the end of construction; nothing downstream
    re-checks or falls back to defaults with `getattr`.
    """

    keys_to_ignore_at_inference = ["past_key_values"]
    # `layer_types` is required, so a default instance cannot exist; this tells
    # transformers not to build one when it serialises.
    has_no_defaults_at_init = True
    layer_type_names: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        layer_types: list[str] | None = None,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        intermediate_size: int = 2816,
        num_hidden_layers: int | None = None,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        qk_norm: bool = False,
        swa_window: int = 128,
        gate_type: str = "elementwise",
        use_sinks: bool = True,
        num_experts: int = 0,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 768,
        norm_topk_prob: bool = False,
        shared_expert_intermediate_size: int = 0,
        mlp_only_layers: list[int] | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        # The base class runs transformers' own validators, which reject our
        # layer names; call it before our fields exist and validate ourselves.
        super().__init__(**kwargs)
        if layer_types is None:
            raise config_error("layer_types", "is required (one entry per layer)", None)
        self.layer_types = list(layer_types)
        self.num_hidden_layers = len(self.layer_types) if num_hidden_layers is None else num_hidden_layers
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim
        if head_dim is None and isinstance(hidden_size, int) and isinstance(num_attention_heads, int):
            self.head_dim = hidden_size // max(num_attention_heads, 1)
        # SPEC §2.6: `head_dim` is the q/k dim; V (and so o_proj's input and the
        # elementwise gates) may be narrower, as in the papers' 192 / 128 layout.
        self.v_head_dim = self.head_dim if v_head_dim is None else v_head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.swa_window = swa_window
        self.gate_type = gate_type
        self.use_sinks = use_sinks
        # MoE MLP (SPEC §2.6; Qwen3-MoE / Qwen2-MoE meaning). Defaults are Qwen3-MoE's;
        # the expert fields are ignored while num_experts is 0 (dense).
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.mlp_only_layers = [] if mlp_only_layers is None else list(mlp_only_layers)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # SPEC names `rope_theta` / `rope_scaling`; transformers 5 and vLLM read
        # `rope_parameters`. Keep both views consistent from one source.
        rope = dict(rope_parameters or rope_scaling or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", rope_theta)
        self.rope_theta = rope["rope_theta"]
        self.rope_parameters = rope
        self._validate()

    @property
    def rope_scaling(self) -> dict | None:
        """The scaling part of `rope_parameters` (None for plain RoPE)."""
        if self.rope_parameters.get("rope_type", "default") == "default":
            return None
        return {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}

    @rope_scaling.setter
    def rope_scaling(self, value: dict | None) -> None:
        rope = {"rope_type": "default"} if value is None else dict(value)
        rope.setdefault("rope_theta", getattr(self, "rope_theta", 10000.0))
        self.rope_parameters = rope

    def validate(self) -> None:
        # transformers calls this on save; its validators reject our layer names.
        self._validate()

    def validate_layer_type(self) -> None:
        self._validate()

    def to_diff_dict(self) -> dict[str, Any]:
        # Write every field: a checkpoint's config.json is a contract (SPEC §2).
        return self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["rope_scaling"] = self.rope_scaling
        return out

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim",
                     "max_position_embeddings", "swa_window"):
            require_positive_int(name, getattr(self, name))
        if len(self.layer_types) != self.num_hidden_layers:
            raise config_error(
                "layer_types", f"must have num_hidden_layers={self.num_hidden_layers} entries",
                f"{len(self.layer_types)} entries")
        for i, kind in enumerate(self.layer_types):
            if kind not in self.layer_type_names:
                raise config_error(f"layer_types[{i}]", f"must be one of {list(self.layer_type_names)}", kind)
        if self.num_attention_heads % self.num_key_value_heads:
            raise config_error(
                "num_key_value_heads",
                f"must divide num_attention_heads={self.num_attention_heads}", self.num_key_value_heads)
        if self.head_dim % 2:
            raise config_error("head_dim", "must be even (RoPE pairs dimensions)", self.head_dim)
        if self.hidden_act != "silu":
            raise config_error("hidden_act", "only 'silu' is supported", self.hidden_act)
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise config_error("rms_norm_eps", "must be a positive number", self.rms_norm_eps)
        for name in ("attention_bias", "qk_norm", "use_sinks", "tie_word_embeddings"):
            require_bool(name, getattr(self, name))
        require_choice("gate_type", self.gate_type, GATE_TYPES)
        self._validate_rope()
        self._validate_moe()

    def _validate_moe(self) -> None:
        require_non_negative_int("num_experts", self.num_experts)
        require_non_negative_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        require_bool("norm_topk_prob", self.norm_topk_prob)
        for i, layer in enumerate(self.mlp_only_layers):
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_hidden_layers:
                raise config_error(f"mlp_only_layers[{i}]", f"must be a layer index in [0, {self.num_hidden_layers})",
                                   layer)
        if len(set(self.mlp_only_layers)) != len(self.mlp_only_layers):
            raise config_error("mlp_only_layers", "must not list a layer twice", self.mlp_only_layers)
        if self.num_experts == 0:
            if self.shared_expert_intermediate_size:
                raise config_error("shared_expert_intermediate_size", "needs num_experts > 0 (a dense model "
                                   "has no shared expert)", self.shared_expert_intermediate_size)
            return
        require_positive_int("num_experts_per_tok", self.num_experts_per_tok)
        require_positive_int("moe_intermediate_size", self.moe_intermediate_size)
        if self.num_experts_per_tok > self.num_experts:
            raise config_error("num_experts_per_tok", f"must be at most num_experts={self.num_experts}",
                               self.num_experts_per_tok)

    def _validate_rope(self) -> None:
        rope = self.rope_parameters
        require_choice("rope_scaling.rope_type", rope.get("rope_type"), SUPPORTED_ROPE_TYPES)
        theta = rope.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise config_error("rope_theta", "must be a positive number", theta)
        if rope["rope_type"] != "default":
            factor = rope.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
                raise config_error("rope_scaling.factor", "must be a positive number", factor)
        if rope["rope_type"] == "yarn":
            # vLLM builds YaRN's cos/sin table for original_max_position_embeddings x factor positions
            # (vllm/model_executor/layers/rotary_embedding/__init__.py, get_rope) and reads past it, giving NaN,
            # at any later position, while it still accepts max_model_len up to max_position_embeddings.
            original = rope.get("original_max_position_embeddings")
            require_positive_int("rope_scaling.original_max_position_embeddings", original)
            if original * factor < self.max_position_embeddings:
                raise config_error(
                    "rope_scaling.original_max_position_embeddings",
                    f"times factor {factor:g} covers {original * factor:g} positions, fewer than "
                    f"max_position_embeddings={self.max_position_embeddings} (vLLM's YaRN table ends there)",
                    original)

    def layers_of_type(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer `layer_idx` has a MoE MLP (SPEC §2.6), False for a dense SwiGLU MLP."""
        return self.num_experts > 0 and layer_idx not in self.mlp_only_layers


def tensor_parallel_heads(config: HySparseBaseConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank at `tensor_parallel_size=tp`, or a one-line error.

    Like vLLM's `QKVParallelLinear`: KV heads are split when `tp` divides
    them and replicated when `tp` exceeds them (`tp / G` ranks hold each KV
    head), which needs `tp` to be a multiple of their count.
    """
    h, g = config.num_attention_heads, config.num_key_value_heads
    if h % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={h}")
    if tp <= g and g % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={g} (or be a multiple of it)")
    if tp > g and tp % g:
        raise ValueError(f"tensor_parallel_size={tp} must be a multiple of num_key_value_heads={g} "
                         "to replicate KV heads (or divide it)")
    return h // tp, max(1, g // tp)


def kv_bytes_per_layer(config: HySparseBaseConfig, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes one token costs in one cache of one rank: K at `head_dim` and V at `v_head_dim` per KV head (SPEC §2.6).

    Every cache stores both at their own widths, window caches too (see
    `vllm_hysparse.models.layers.window_attention`), so this holds for all of them.
    Under tensor parallelism a rank stores its `max(1, G / tp)` KV heads.
    """
    return tensor_parallel_heads(config, tp)[1] * (config.head_dim + config.v_head_dim) * dtype_bytes


def kv_report(config: HySparseBaseConfig, dtype_bytes: int, kv_memory_bytes: int | None, tp: int = 1) -> str:
    """One line for the server log: KV bytes per token (SPEC §3.4) and, given the KV memory, tokens that fit.

    Window caches are bounded (`swa_window` tokens per sequence each), so the
    context that fits is set by the full-length caches; vLLM's own "KV cache
    size" line counts every cache group as full length and understates it.
    Under tensor parallelism (`tp > 1`) the bytes are those of one rank, as is
    vLLM's KV memory: replicated KV heads cost every rank that holds them.
    """
    per_layer = kv_bytes_per_layer(config, dtype_bytes, tp)
    full, windowed = config.kv_cache_layers()
    scope = "" if tp == 1 else (f" per rank (tensor_parallel_size={tp}: {tensor_parallel_heads(config, tp)[1]} "
                                f"of {config.num_key_value_heads} KV heads each)")
    line = (f"HySparse KV cache{scope}: {per_layer * full} bytes/token in {full} full-length caches "
            f"+ {windowed} window caches of {config.swa_window} tokens ({per_layer * windowed * config.swa_window} "
            f"bytes/sequence); a dense model of this shape needs {per_layer * config.num_hidden_layers} bytes/token")
    if kv_memory_bytes:
        line += f"; {kv_memory_bytes / 2**30:.2f} GiB of KV memory holds about {kv_memory_bytes // (per_layer * full):,} tokens"
    return line


def kv_bytes_per_token(config: HySparseBaseConfig, dtype_bytes: int, context_len: int) -> dict[str, float]:
    """KV bytes per token at `context_len` tokens (SPEC §3.4).

    Full-length caches grow with the context; window caches hold at most
    `swa_window` tokens each, so their per-token share shrinks as the context
    grows. Returns the counts and the bytes so callers can print them.
    """
    per_layer = kv_bytes_per_layer(config, dtype_bytes)
    full, windowed = config.kv_cache_layers()
    window_tokens = min(config.swa_window, context_len)
    total = per_layer * (full + windowed * window_tokens / context_len)
    return {"full_length_caches": full, "window_caches": windowed,
            "bytes_per_token": total, "dense_bytes_per_token": per_layer * config.num_hidden_layers}
