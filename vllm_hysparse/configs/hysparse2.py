# SPDX-License-Identifier: Apache-2.0
"""HySparse2 config: self-decoder (full + sliding) and bridged cross-decoder (SPEC §2.3)."""

from vllm_hysparse.configs.base import (
    HySparseBaseConfig,
    config_error,
    require_bool,
    require_choice,
    require_positive_int,
)

FULL = "full_attention"
SLIDING = "sliding_attention"
SPARSE = "sparse_attention"
HEAD_REDUCTIONS = ("max", "sum")


class HySparse2Config(HySparseBaseConfig):
    """Config of a HySparse2 checkpoint.

    Layers `[0, num_self_decoder_layers)` are the self-decoder (full or
    sliding, each owning its KV); the rest are the cross-decoder (full or
    sparse, owning no KV). Cross full layer number `c` (in layer order) projects
    its K/V from the residual stream entering self layer `bridge_sources[c]`;
    a cross sparse layer attends over the cache of the nearest cross full layer
    before it.
    """

    model_type = "hysparse2"
    layer_type_names = (FULL, SLIDING, SPARSE)

    def __init__(
        self,
        *,
        num_self_decoder_layers: int | None = None,
        bridge_sources: list[int] | None = None,
        sparse_topk_tokens: int = 1024,
        recent_window: int = 128,
        score_head_reduce: str = "max",
        swa_rope_theta: float = 10000.0,
        swa_rotary_dim: int = 64,
        full_rope: bool = False,
        **kwargs,
    ):
        if num_self_decoder_layers is None:
            raise config_error("num_self_decoder_layers", "is required", None)
        if bridge_sources is None:
            raise config_error("bridge_sources", "is required (one entry per cross-decoder full layer)", None)
        self.num_self_decoder_layers = num_self_decoder_layers
        self.bridge_sources = list(bridge_sources)
        self.sparse_topk_tokens = sparse_topk_tokens
        self.recent_window = recent_window
        self.score_head_reduce = score_head_reduce
        self.swa_rope_theta = swa_rope_theta
        self.swa_rotary_dim = swa_rotary_dim
        self.full_rope = full_rope
        kwargs.setdefault("architectures", ["HySparse2ForCausalLM"])
        super().__init__(**kwargs)

    def _validate(self) -> None:
        super()._validate()
        for name in ("sparse_topk_tokens", "recent_window", "swa_rotary_dim"):
            require_positive_int(name, getattr(self, name))
        require_choice("score_head_reduce", self.score_head_reduce, HEAD_REDUCTIONS)
        require_bool("full_rope", self.full_rope)
        if self.swa_rotary_dim % 2 or self.swa_rotary_dim > self.head_dim:
            raise config_error(
                "swa_rotary_dim", f"must be even and at most head_dim={self.head_dim}", self.swa_rotary_dim)
        theta = self.swa_rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise config_error("swa_rope_theta", "must be a positive number", theta)
        self._validate_split()
        self._validate_bridges()

    def _validate_split(self) -> None:
        n_self, n_layers = self.num_self_decoder_layers, self.num_hidden_layers
        if isinstance(n_self, bool) or not isinstance(n_self, int) or not 0 < n_self < n_layers:
            raise config_error(
                "num_self_decoder_layers",
                f"must be an integer in [1, num_hidden_layers-1={n_layers - 1}] so both decoders are non-empty",
                n_self)
        for i, kind in enumerate(self.layer_types):
            if i < n_self and kind == SPARSE:
                raise config_error(
                    f"layer_types[{i}]", "self-decoder layers must be 'full_attention' or 'sliding_attention'", kind)
            if i >= n_self and kind == SLIDING:
                raise config_error(
                    f"layer_types[{i}]", "cross-decoder layers must be 'full_attention' or 'sparse_attention'", kind)
        if self.layer_types[n_self] != FULL:
            raise config_error(
                f"layer_types[{n_self}]",
                "the first cross-decoder layer must be 'full_attention' (sparse layers reuse its cache)",
                self.layer_types[n_self])

    def _validate_bridges(self) -> None:
        cross_full = self.cross_full_layers
        if len(self.bridge_sources) != len(cross_full):
            raise config_error(
                "bridge_sources",
                f"must have one entry per cross-decoder full layer ({len(cross_full)}: {cross_full})",
                self.bridge_sources)
        for c, src in enumerate(self.bridge_sources):
            ok = (not isinstance(src, bool) and isinstance(src, int)
                  and 0 <= src < self.num_self_decoder_layers and self.layer_types[src] == FULL)
            if not ok:
                raise config_error(
                    f"bridge_sources[{c}]", "must be the index of a self-decoder 'full_attention' layer", src)

    def kv_cache_layers(self) -> tuple[int, int]:
        """(full-length caches, window-bounded caches): self full + bridged cross full; sliding layers."""
        return len(self.layers_of_type(FULL)), len(self.layers_of_type(SLIDING))

    @property
    def cross_full_layers(self) -> list[int]:
        return [i for i in self.layers_of_type(FULL) if i >= self.num_self_decoder_layers]

    @property
    def bridge_source(self) -> dict[int, int]:
        """Cross full layer index -> self layer whose input residual stream it projects."""
        return dict(zip(self.cross_full_layers, self.bridge_sources))

    @property
    def oracle_layer(self) -> dict[int, int]:
        """Cross sparse layer index -> the cross full layer whose cache and selection it reuses."""
        out, last_full = {}, None
        for i in range(self.num_self_decoder_layers, self.num_hidden_layers):
            if self.layer_types[i] == FULL:
                last_full = i
            else:
                out[i] = last_full
        return out
