# SPDX-License-Identifier: Apache-2.0
"""HySparse config: hybrid blocks of one full layer and N sparse layers (SPEC §2.1)."""

from vllm_hysparse.configs.base import HySparseBaseConfig, config_error, require_positive_int

FULL = "full_attention"
SPARSE = "sparse_attention"


class HySparseConfig(HySparseBaseConfig):
    """Config of a HySparse checkpoint.

    Every sparse layer reads the KV cache and the oracle block indices of the
    nearest full layer before it (`oracle_layer[i]`), so the first layer must
    be full.
    """

    model_type = "hysparse"
    layer_type_names = (FULL, SPARSE)

    def __init__(
        self,
        *,
        sparse_block_size: int = 64,
        sparse_topk_blocks: int = 16,
        **kwargs,
    ):
        self.sparse_block_size = sparse_block_size
        self.sparse_topk_blocks = sparse_topk_blocks
        kwargs.setdefault("architectures", ["HySparseForCausalLM"])
        super().__init__(**kwargs)

    def _validate(self) -> None:
        super()._validate()
        require_positive_int("sparse_block_size", self.sparse_block_size)
        require_positive_int("sparse_topk_blocks", self.sparse_topk_blocks)
        if self.layer_types[0] != FULL:
            raise config_error(
                "layer_types[0]",
                "must be 'full_attention': a sparse layer needs a full layer before it as its oracle",
                self.layer_types[0])

    def kv_cache_layers(self) -> tuple[int, int]:
        """(full-length caches, window-bounded caches): one per full layer, one SWA cache per sparse layer."""
        full = len(self.layers_of_type(FULL))
        return full, self.num_hidden_layers - full

    @property
    def oracle_layer(self) -> dict[int, int]:
        """Sparse layer index -> index of the full layer whose KV and indices it reuses."""
        out, last_full = {}, None
        for i, kind in enumerate(self.layer_types):
            if kind == FULL:
                last_full = i
            else:
                out[i] = last_full
        return out
